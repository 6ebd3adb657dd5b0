"""Batch-invariant verify (offload/graphs.py, fixed rows; draft/offloaded.py verify_decoder).

The target here is the tiny preset widened to hidden 1536: at that width an Intel Xeon VM's bf16
matrix products round a single-token forward differently from a block's (measured: logits apart by
2.4e-4), which is what made oracle mode refuse its own draws in bf16; an AMD EPYC VM's round them
alike. With fixed rows every position's logits are the same bits whatever block it is verified in,
the oracle's reference is never contradicted, and speculative output equals plain decoding through
the same rows. Oracle mode checks first (rows_agree) and pads only where blocks round apart; the
tests that need a machine whose blocks round apart make one by nudging a block's logits."""

import dataclasses

import pytest
import torch

from pdflash import PdflashError
from pdflash.offload.config import ModelPreset
from pdflash.offload.graphs import GraphedDecoder
from pdflash.offload.runtime import OffloadedModel
from pdflash.offload.synthetic import write_checkpoint

PROMPT = [5, 77, 200, 31, 9, 100, 250, 17, 3, 44, 81, 90]
TOKENS = [11, 22, 33, 44, 55, 66, 77, 88]
WIDE = dataclasses.replace(ModelPreset.from_name("tiny"), name="tiny-wide", hidden_size=1536, intermediate_size=64,
                           num_hidden_layers=2, layer_types=())


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory):
    from pdflash.draft import write_synthetic_draft

    out = tmp_path_factory.mktemp("wide")
    write_checkpoint(out / "target", WIDE, mxfp4=True, dtype="bfloat16", seed=3)
    write_synthetic_draft(out / "draft", "tiny", target_dir=out / "target", seed=2, dtype="bfloat16")
    return out


def _rows_by_block(dec: GraphedDecoder, lengths) -> dict[int, dict[tuple[int, int], torch.Tensor]]:
    """Logits of positions 0..7 after the prompt, computed in blocks of each length in
    ``lengths`` at every alignment: {position: {(length, block start): logits}}."""
    dec.prefill(PROMPT)
    at = dec.length
    out: dict[int, dict] = {}
    for T in lengths:
        for start in range(0, len(TOKENS) - T + 1, T):
            dec.truncate(at + start)
            logits = dec.decode(TOKENS[start]) if T == 1 else dec.forward(TOKENS[start:start + T])[0]
            for i in range(T):
                out.setdefault(start + i, {})[(T, start)] = logits[i]
    return out


def test_fixed_rows_give_every_position_the_same_bits_in_any_block(wide_pair):
    with OffloadedModel.load(wide_pair / "target") as rt:
        assert rt.dtype == torch.bfloat16
        got = _rows_by_block(GraphedDecoder(rt, max_len=len(PROMPT) + 8, graphs=False, rows=4), (1, 2, 3, 4))
        for pos, by_block in got.items():
            first = next(iter(by_block.values()))
            for key, logits in by_block.items():
                assert torch.equal(logits, first), f"position {pos}: block {key} rounds apart"
        assert len(got[0]) == len(got[5]) == 4 and len(got[6]) == 3  # (blocks of 3 stop at position 5)


def test_fixed_rows_steps_make_the_cpu_experts_batch_invariant(wide_pair):
    """Every expert on the CPU (the native kernel): a fixed-rows decoder's steps turn the kernel's
    batch invariance on (no AMX tiles for experts of several tokens: where a CPU has them they round
    apart from one-token calls), its prefill and a decoder without fixed rows turn it off, and every
    position gets the same bits in any block."""
    with OffloadedModel.load(wide_pair / "target", cpu_experts="all") as rt:
        kernel = rt.cpu.kernel
        dec = GraphedDecoder(rt, max_len=len(PROMPT) + 8, graphs=False, rows=4)
        dec.prefill(PROMPT)
        assert not kernel.invariant  # the prompt: the kernel's fastest choice
        dec.decode(TOKENS[0])
        assert kernel.invariant
        other = GraphedDecoder(rt, max_len=len(PROMPT) + 8, graphs=False)
        other.prefill(PROMPT)
        other.forward(TOKENS[:3])
        assert not kernel.invariant
        dec.truncate(len(PROMPT))
        dec.forward(TOKENS[:3])
        assert kernel.invariant
        experts0 = rt.cpu.experts
        got = _rows_by_block(dec, (1, 2, 3, 4))
        assert rt.cpu.experts > experts0  # the CPU computed them
        for pos, by_block in got.items():
            first = next(iter(by_block.values()))
            for key, logits in by_block.items():
                assert torch.equal(logits, first), f"position {pos}: block {key} rounds apart"


def test_fixed_rows_compute_the_model(wide_pair):
    """float32: the padded forward computes what the unpadded one does (padding rows reach no real
    row), the experts run on the real tokens only, and the features are the real rows'."""
    with OffloadedModel.load(wide_pair / "target", dtype="float32", expert_cache_experts=4) as rt:
        def run(rows):
            rt.reset_cache()
            dec = GraphedDecoder(rt, max_len=len(PROMPT) + 8, graphs=False, rows=rows)
            dec.tap_layers = [1]
            dec.prefill(PROMPT)
            a, fa = dec.forward(TOKENS[:3])
            b = dec.decode(TOKENS[3])
            c, fc = dec.forward(TOKENS[4:8])
            st = rt.stats()["cache"]
            return torch.cat([a, b, c]), torch.cat([fa, fc], 1), st["hits"] + st["misses"]

        want, want_f, want_n = run(None)
        got, got_f, got_n = run(4)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_f, want_f, rtol=1e-4, atol=1e-4)
        assert got_f.shape == (1, 7, 1536)
        assert got_n == want_n  # the same expert lookups: padding rows route nowhere


def test_fixed_rows_limits(wide_pair):
    with OffloadedModel.load(wide_pair / "target") as rt:
        dec = GraphedDecoder(rt, max_len=len(PROMPT) + 3, graphs=False, rows=4)
        assert dec.capacity == len(PROMPT) + 3 + 3
        dec.prefill(PROMPT)
        with pytest.raises(PdflashError, match="longer than this decoder's 4 fixed rows"):
            dec.forward(TOKENS[:5])
        with pytest.raises(PdflashError, match="positions"):
            dec.forward(TOKENS[:4])  # room for 3 more
        dec.forward(TOKENS[:3])  # the padding rows fit in the spare positions
        with pytest.raises(PdflashError, match="at least 1"):
            GraphedDecoder(rt, max_len=8, graphs=False, rows=0)


def _nudge_blocks(monkeypatch):
    """Make this machine one whose unpadded verify blocks round apart from single steps: every
    logit of an unpadded block of two or more tokens moves one float32 step up."""
    eager = GraphedDecoder._forward_eager

    def nudged(self, tokens, last=True, pad=False):
        logits, feats = eager(self, tokens, last, pad)
        if len(tokens) > 1 and not pad and not last:
            logits = torch.nextafter(logits, torch.full_like(logits, float("inf")))
        return logits, feats

    monkeypatch.setattr(GraphedDecoder, "_forward_eager", nudged)


def test_rows_agree_compares_every_block_length_with_single_steps(wide_pair, monkeypatch):
    """rows_agree says what comparing each position's logits across blocks says (the independent
    reference: _rows_by_block at every alignment); a block that rounds apart, of any length, makes
    it say so; lengths past the decoder's room are left out."""
    from pdflash.draft.offloaded import rows_agree

    with OffloadedModel.load(wide_pair / "target") as rt:
        dec = GraphedDecoder(rt, max_len=len(PROMPT) + 8, graphs=False)
        got = _rows_by_block(dec, (1, 2, 3, 4))
        alike = all(torch.equal(logits, by_block[(1, pos)]) for pos, by_block in got.items() for logits in by_block.values())
        assert rows_agree(dec, PROMPT, [1, 2, 3, 4], TOKENS, span=8) == alike
        assert dec.length == len(PROMPT)  # it leaves the prompt
        for lengths in ([1, 2], [1, 3], [1, 4]):  # each length's own blocks, against the reference
            want = all(torch.equal(got[pos][(b, s)], got[pos][(1, pos)]) for pos in got for (b, s) in got[pos] if b == lengths[1])
            assert rows_agree(dec, PROMPT, lengths, TOKENS, span=8) == want
        _nudge_blocks(monkeypatch)
        assert not rows_agree(dec, PROMPT, [1, 2, 3, 4])
        assert not rows_agree(dec, PROMPT, [1, 3])
        assert rows_agree(dec, PROMPT, [1])  # nothing to compare
        short = GraphedDecoder(rt, max_len=len(PROMPT) + 1, graphs=False)
        assert rows_agree(short, PROMPT, [1, 2, 3, 4])  # no block fits


@pytest.mark.parametrize("blocks_round_apart", [False, True])
def test_oracle_in_bf16_is_never_contradicted_and_speculation_is_lossless(wide_pair, monkeypatch, blocks_round_apart):
    """Oracle mode in bf16, block planner or fixed blocks: the check decides the rows (fixed rows
    where blocks round apart from single steps, none where they agree); either way no divergence,
    no repair forward, and the output is plain greedy decoding through the decoder that verified
    it. (On this small model the rounding differences rarely flip an argmax; the bit-level
    property is the first test's.)"""
    from pdflash.draft.offloaded import load_runtime_draft, speculative_on_runtime

    if blocks_round_apart:
        _nudge_blocks(monkeypatch)
    calls = []
    eager = GraphedDecoder._forward_eager
    monkeypatch.setattr(GraphedDecoder, "_forward_eager",
                        lambda self, tokens, last=True, pad=False: calls.append((len(tokens), pad)) or eager(self, tokens, last, pad))
    n = 24
    with OffloadedModel.load(wide_pair / "target", expert_cache_experts=8, block_tokens=4) as rt:
        draft = load_runtime_draft(rt, wide_pair / "draft")
        plains = {}
        for rows in (None, draft.config.block_size):
            dec = GraphedDecoder(rt, max_len=len(PROMPT) + n, graphs=False, rows=rows)
            plain = [int(dec.prefill(PROMPT).argmax())]
            while len(plain) < n:
                plain.append(int(dec.decode(plain[-1]).argmax()))
            plains[rows] = plain
        for block in ("auto", 2, 4):
            rt.reset_cache()
            calls.clear()
            res = speculative_on_runtime(rt, draft, PROMPT, n, block_size=block, acceptance=0.8, predictor="none",
                                         eos_token_ids=[], seed=1)
            if blocks_round_apart:
                assert res.verify_rows_check == "differ"
            assert res.verify_rows == (None if res.verify_rows_check == "agree" else draft.config.block_size)
            assert (True in {pad for T, pad in calls}) == (res.verify_rows is not None), calls
            assert res.oracle["oracle_divergences"] == 0 and res.oracle["oracle_refreshes"] == 0
            assert res.token_ids == plains[res.verify_rows], f"block {block}"
            if block != "auto":
                assert res.stats.acceptance_length > 1.5  # the draws, not rounding, decide acceptance
        rt.reset_cache()
        res = speculative_on_runtime(rt, draft, PROMPT, n, block_size=4, predictor="none", eos_token_ids=[],
                                     batch_invariant=True)  # the real draft, asked for fixed rows
        assert res.verify_rows == 4 and res.verify_rows_check is None and res.token_ids == plains[4]


def test_generate_reports_and_checks_batch_invariant(run, wide_pair):
    import json

    code, out, err = run("generate", "hello", "--model", str(wide_pair / "target"), "--draft", str(wide_pair / "draft"),
                         "--draft-acceptance", "0.9", "--max-new-tokens", "6", "--expert-cache-experts", "8", "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["verify_rows_check"] in ("agree", "differ") and rep["oracle_divergences"] == 0
    assert rep["verify_rows"] == (None if rep["verify_rows_check"] == "agree" else 4)
    code, out, err = run("generate", "hello", "--model", str(wide_pair / "target"), "--draft", str(wide_pair / "draft"),
                         "--draft-acceptance", "0.9", "--max-new-tokens", "6", "--batch-invariant", "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["verify_rows"] == 4 and rep["verify_rows_check"] is None and rep["oracle_divergences"] == 0
    code, out, err = run("generate", "hello", "--model", str(wide_pair / "target"), "--draft", str(wide_pair / "draft"),
                         "--draft-acceptance", "0.9", "--max-new-tokens", "6", "--no-batch-invariant", "--json")
    assert code == 0, err
    assert json.loads(out)["verify_rows"] is None
    code, out, err = run("generate", "hello", "--model", str(wide_pair / "target"), "--batch-invariant")
    assert code == 2 and "--batch-invariant only applies to speculative decoding: add --draft DIR" in err
    assert "Traceback" not in err


@pytest.mark.gpu
def test_cuda_graphs_with_fixed_rows(wide_pair):
    """On a GPU, graphed: every position's logits are the same bits in any block (cuBLAS picks its
    kernels by shape, so without fixed rows they are not), and the graphed steps compute what the
    same fixed-rows segments compute eagerly."""
    with OffloadedModel.load(wide_pair / "target", device="cuda", expert_cache_experts=8, block_tokens=4) as rt:
        graphed = _rows_by_block(GraphedDecoder(rt, max_len=len(PROMPT) + 8, graphs=True, rows=4), (1, 2, 3, 4))
        for pos, by_block in graphed.items():
            first = next(iter(by_block.values()))
            for key, logits in by_block.items():
                assert torch.equal(logits, first), f"position {pos}: block {key} rounds apart"
        rt.reset_cache()
        eager = _rows_by_block(GraphedDecoder(rt, max_len=len(PROMPT) + 8, graphs=False, rows=4), (4,))
        for pos in range(len(TOKENS)):
            torch.testing.assert_close(graphed[pos][(4, pos - pos % 4)], eager[pos][(4, pos - pos % 4)], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_cuda_oracle_in_bf16_has_no_divergence(wide_pair):
    from pdflash.draft.offloaded import load_runtime_draft, speculative_on_runtime

    n = 32
    with OffloadedModel.load(wide_pair / "target", device="cuda", expert_cache_experts=8, block_tokens=4) as rt:
        draft = load_runtime_draft(rt, wide_pair / "draft")
        for block in ("auto", 2, 4):
            rt.reset_cache()
            res = speculative_on_runtime(rt, draft, PROMPT, n, block_size=block, acceptance=0.8, predictor="none",
                                         eos_token_ids=[], seed=1)
            assert res.verify_rows_check in ("agree", "differ")  # fixed rows only where blocks round apart
            assert res.verify_rows == (None if res.verify_rows_check == "agree" else 4)
            assert res.oracle["oracle_divergences"] == 0 and res.oracle["oracle_refreshes"] == 0, block


def _replaying_capture(self, bucket: int, T: int) -> list:
    """``GraphedDecoder._capture`` for a CPU: the same segments, each "replay" running its
    function again and publishing its outputs where the captured tensors would be. Lets the
    CPU check the graphed step's own bookkeeping (static inputs, padding rows, experts on the real
    rows, taps, logits) that CUDA replays."""
    from types import SimpleNamespace

    n, H = len(self.layers), self.model.config.hidden_size
    ids, pos = self._static_inputs(T)
    e_in = [torch.zeros((T, H), dtype=self.dtype) for _ in range(n)]
    outs: list = [None] * (n + 1)

    def seg0():
        self.kv.positions, self.kv.visible = pos, bucket
        x, pe, masks = self._embed(ids, pos, bucket)
        x, flat, scores, indices = self._pre_experts(0, x, pe, masks)
        outs[0] = {"pe": pe, "masks": masks, "x": x, "flat": flat, "scores": scores, "indices": indices}

    def mid(i):
        def seg():
            prev = outs[i - 1]
            x, flat, scores, indices = self._pre_experts(i, prev["x"] + e_in[i - 1].view_as(prev["x"]), prev["pe"],
                                                         prev["masks"])
            outs[i] = {"pe": prev["pe"], "masks": prev["masks"], "x": x, "flat": flat, "scores": scores, "indices": indices}
        return seg

    def head():
        last = outs[n - 1]
        outs[n] = {"logits": self._head(last["x"] + e_in[n - 1].view_as(last["x"]), last=T == 1 and self.rows is None)}

    segs = [SimpleNamespace(replay=f) for f in [seg0] + [mid(i) for i in range(1, n)] + [head]]
    return [segs, outs, e_in]


@pytest.mark.parametrize("rows", [None, 4], ids=["per-block", "fixed-rows"])
def test_graphed_step_bookkeeping_on_the_cpu(wide_pair, monkeypatch, rows):
    """The graphed step (its segments replayed as above) gives the eager step's logits and
    features, bit for bit, for blocks of every length, with and without fixed rows."""
    monkeypatch.setattr(GraphedDecoder, "_capture", _replaying_capture)
    with OffloadedModel.load(wide_pair / "target", expert_cache_experts=8, block_tokens=4) as rt:
        def run(graphed):
            rt.reset_cache()
            dec = GraphedDecoder(rt, max_len=len(PROMPT) + 10, graphs=False, rows=rows)
            dec.graphs = graphed
            dec.tap_layers = [0, 1]
            dec.prefill(PROMPT)
            logits, feats = [dec.decode(TOKENS[0])], []
            for block in (TOKENS[1:4], TOKENS[4:5], TOKENS[5:7], [3, 9, 27]):
                lg, f = dec.forward(block)
                logits.append(lg)
                feats.append(f)
            st = rt.stats()["cache"]
            return torch.cat(logits), torch.cat(feats, 1), st["hits"] + st["misses"], sorted(dec._steps)

        want, want_f, want_n, _ = run(False)
        got, got_f, got_n, steps = run(True)
        assert torch.equal(got, want) and torch.equal(got_f, want_f) and got_n == want_n
        assert got.shape[0] == 10 and got_f.shape[:2] == (1, 9)
        assert steps == ([(len(PROMPT) + 13, 4)] if rows else [(len(PROMPT) + 10, T) for T in (1, 2, 3)])  # (keys, rows)
