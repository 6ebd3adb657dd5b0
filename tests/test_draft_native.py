"""The native draft pass (native/pf_draft.c through pdflash.native.draft_pass): the draft's forward
against the from-scratch reference and against its own PyTorch operators, at every CPU level;
its bf16 matrices; the fallbacks; the greedy head against PyTorch's; errors; the C stress test."""

import json
import os
import subprocess

import pytest
import torch

from pdflash.draft import load_draft, write_synthetic_draft
from pdflash.draft.model import DFlashDraftModel
from pdflash.native.cpu_experts import LEVELS, detect_level
from pdflash.native.draft_pass import DraftPass, DraftPassError, DraftShape
import stress_programs
import test_draft_model
from test_draft_model import reference_hidden

pair = test_draft_model.pair  # the fixture: a tiny float32 target, its synthetic draft and their folder

LEVELS_HERE = [lv for lv in ("scalar", "avx2") if LEVELS.index(lv) <= LEVELS.index(detect_level())]


def native_draft(pair, level=None, **kwargs):
    """A fresh draft of the ``pair`` fixture (target, draft, root) with the native pass on."""
    target, _, root = pair
    draft = load_draft(root / "draft", target, **kwargs)
    assert draft.use_native(level=level) and draft.native
    return draft


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_native_forward_matches_the_reference(pair, level):
    """Context appended a few tokens at a time, then in the forward itself: the native pass
    gives the reference's hidden rows and the PyTorch operators' cache."""
    target, _, root = pair
    draft = native_draft(pair, level)
    torch.manual_seed(0)
    feats = torch.randn(1, 9, 3 * 32)
    block = draft.block_ids(17, 4, "cpu")
    want = reference_hidden(draft, feats, block)
    for lo, hi in ((0, 3), (3, 5), (5, 9)):
        draft.append_context(feats[:, lo:hi])
    torch.testing.assert_close(draft(block, start=9), want, rtol=1e-5, atol=1e-5)
    draft.reset_context()
    draft.append_context(feats[:, :6])
    torch.testing.assert_close(draft(block, start=9, context=feats[:, 6:]), want, rtol=1e-5, atol=1e-5)
    plain = load_draft(root / "draft", target)  # the same model on PyTorch operators
    plain.append_context(feats)
    plain(block, start=9)
    for name in ("keys", "values"):
        torch.testing.assert_close(getattr(draft.cache, name)[:, :, :, :9], getattr(plain.cache, name)[:, :, :, :9],
                                   rtol=1e-5, atol=1e-6)
    assert draft.native


def test_native_sliding_window_and_block_sizes_match_the_operators(pair):
    """Mixed sliding / full layers, blocks of 1..8 after growing context (the cache doubling on
    the way, one step over NATIVE_MAX_ROWS through the operators): the native pass and PyTorch's
    operators agree step by step."""
    target, _, root = pair
    cfg = json.loads((root / "draft" / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    from pdflash.draft.config import DFlashConfig
    from pdflash.draft.synthetic import synthetic_draft_tensors

    config = DFlashConfig.from_dict(cfg)
    models = []
    for _ in range(2):
        m = DFlashDraftModel(config, target.model.embed_tokens, target.lm_head)
        m.load_state_dict(synthetic_draft_tensors(config, 5, torch.float32))
        models.append(m.eval().pack())
    native, plain = models
    assert native.use_native()
    calls = []
    run = native._native.run
    native._native.run = lambda *a: calls.append(1) or run(*a)
    torch.manual_seed(2)
    feats = torch.randn(1, 400, 3 * 32)
    at = 0
    for step, (n, b) in enumerate([(5, 4), (1, 1), (3, 8), (2, 2), (0, 5), (300, 3), (4, 6), (1, 7)]):
        got, want = (m(m.block_ids(11 + step, b, "cpu"), at + n, context=feats[:, at : at + n]) for m in models)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        at += n
    assert native.cache.capacity > 256 and native.native
    assert len(calls) == 7  # every step but the 300-row one ran natively


def test_bf16_checkpoint_reads_bf16_matrices_with_the_same_results(tmp_path, pair):
    """A bf16 draft loaded in float32 (as generate does on a CPU): the kernel reads bf16 copies
    of the matrices, with the products of the float32 weights."""
    target, _, root = pair
    write_synthetic_draft(tmp_path / "d16", "tiny", target_dir=root / "target", seed=4, dtype="bfloat16")
    native = load_draft(tmp_path / "d16", target, dtype=torch.float32)
    assert native.use_native() and native._native.matrices_dtype == torch.bfloat16
    plain = load_draft(tmp_path / "d16", target, dtype=torch.float32)
    torch.manual_seed(3)
    feats = torch.randn(1, 7, 3 * 32)
    outs = [m(m.block_ids(5, 6, "cpu"), 7, context=feats) for m in (native, plain)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert native_draft(pair)._native.matrices_dtype == torch.float32  # random float32 weights stay float32


def test_replaced_or_moved_weights_leave_the_native_pass(pair):
    target, _, root = pair
    draft = native_draft(pair)
    torch.manual_seed(5)
    feats = torch.randn(1, 6, 3 * 32)
    block = draft.block_ids(17, 4, "cpu")
    with torch.no_grad():
        draft.layers[1].self_attn.o_proj.weight = torch.nn.Parameter(draft.layers[1].self_attn.o_proj.weight * 2)
    draft.append_context(feats)
    torch.testing.assert_close(draft(block, start=6), reference_hidden(draft, feats, block), rtol=1e-5, atol=1e-5)
    assert not draft.native
    draft = native_draft(pair)
    draft.norm.weight.data = draft.norm.weight.data + 1  # same Parameter, new storage
    draft.append_context(feats)
    torch.testing.assert_close(draft(block, start=6), reference_hidden(draft, feats, block), rtol=1e-5, atol=1e-5)
    assert not draft.native
    moved = load_draft(root / "draft", target).to(torch.float64)
    assert not moved.use_native() and not moved.native
    assert not load_draft(root / "draft", target).use_native(enable=False)


@pytest.mark.parametrize("head_dtype", [torch.float32, torch.bfloat16])
def test_native_greedy_head_matches_the_head(pair, head_dtype):
    """propose() through the native head gives the head's argmax (bf16 weights: the rows and
    logits rounded as a bf16 head rounds them), wherever the two best logits are apart."""
    target, _, _ = pair
    draft = native_draft(pair)
    torch.manual_seed(7)
    head = torch.nn.Linear(32, 3000, bias=False).to(head_dtype)
    draft._shared = (draft.embed_tokens, head)
    hidden = torch.randn(200, 32)
    got = draft.propose(hidden)
    logits = head(hidden.to(head_dtype)).float()
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > (0.05 if head_dtype == torch.bfloat16 else 1e-4)
    assert clear.sum() >= 100
    assert torch.equal(got[clear], logits.argmax(-1)[clear])
    assert draft.propose(hidden[:0]).shape == (0,)


def test_native_head_ties_go_to_the_first_index(pair):
    draft = native_draft(pair)
    w = torch.zeros(50, 32, dtype=torch.bfloat16)
    w[[7, 20, 31], 0] = 1.0
    w[20, 1] = 0.001  # below bf16's resolution at 1.0 once the logit is rounded
    hidden = torch.zeros(2, 32)
    hidden[:, 0] = 1.0
    hidden[1, 1] = 1.0
    assert draft._native.argmax(hidden, w).tolist() == [7, 7]
    assert draft._native.argmax(hidden, w.float()).tolist() == [7, 20]


def test_kernel_refuses_bad_inputs_with_one_clear_error(pair):
    draft = native_draft(pair)
    k = draft._native
    draft.append_context(torch.randn(1, 3, 96))
    keys, values = draft.cache.keys, draft.cache.values
    cos, sin = draft._rope_tables(300)
    x = torch.randn(4, 32)
    with pytest.raises(DraftPassError, match="invalid|argument"):
        k.run(keys, values, keys.shape[3] - 2, None, x, cos, sin)  # past the cache's capacity
    with pytest.raises(DraftPassError, match="x must be"):
        k.run(keys, values, 3, None, x.double(), cos, sin)
    with pytest.raises(DraftPassError, match="caches"):
        k.run(keys[:, :, :, :, :4].contiguous(), values[:, :, :, :, :4].contiguous(), 3, None, x, cos, sin)
    with pytest.raises(DraftPassError, match="head weight"):
        k.argmax(x, torch.randn(10, 32, dtype=torch.float16))
    shape = DraftShape(32, 4, 2, 8, 64, 96, 1e-5)
    with pytest.raises(DraftPassError, match="fc must be"):
        DraftPass(shape, torch.randn(32, 95), torch.ones(32), torch.ones(32), [], [])
    with pytest.raises(DraftPassError, match="unknown CPU level 'sse9'"):
        DraftPass(k.shape, draft.fc.weight, draft.hidden_norm.weight, draft.norm.weight, [], [], level="sse9")
    with pytest.raises(DraftPassError, match="does not take this shape"):
        DraftPass(DraftShape(32, 4, 3, 8, 64, 96, 1e-5), torch.randn(32, 96), torch.ones(32), torch.ones(32), [], [])


def test_a_shape_the_kernel_does_not_take_stays_on_the_operators(pair, monkeypatch):
    import pdflash.native.draft_pass as dp

    monkeypatch.setattr(dp, "MAX_HEAD_DIM", 4)  # the tiny draft's head_dim is 8
    target, _, root = pair
    draft = load_draft(root / "draft", target)
    assert not draft.use_native() and not draft.native
    feats = torch.randn(1, 5, 3 * 32)
    block = draft.block_ids(3, 4, "cpu")
    draft.append_context(feats)
    torch.testing.assert_close(draft(block, start=5), reference_hidden(draft, feats, block), rtol=1e-5, atol=1e-5)


def test_runtime_draft_is_native_on_the_cpu_and_lossless():
    """generate's draft on the CPU device runs natively, and speculative decoding with it gives
    plain greedy decoding's tokens."""
    from pdflash.draft import speculative_generate
    from pdflash.draft.offloaded import load_runtime_draft
    from pdflash.draft.speculative import greedy_generate
    from pdflash.offload.embedded import embedded_draft, embedded_target
    from pdflash.offload.runtime import OffloadedModel

    with OffloadedModel.load(embedded_target(), device="cpu", expert_cache_experts=64) as rt:
        draft = load_runtime_draft(rt, embedded_draft())
        assert draft.native
        ids = rt.tokenizer("def fibonacci(n):").input_ids
        want = greedy_generate(rt.model, ids, 40)
        for block in (2, 4, 8):
            got = speculative_generate(rt.model, draft, ids, 40, block_size=block)
            assert got.token_ids == want
            assert got.stats.acceptance_length > 1.0
        assert draft.native


@pytest.mark.skipif(stress_programs.COMPILER is None, reason="no C compiler")
def test_c_draft_stress_quick(tmp_path):
    """native/stress/draft_stress.c (the Makefile runs it under the sanitizers), built plainly."""
    stress_programs.run_quick(tmp_path, "draft_stress", ["pf_draft.c", "pf_cpu.c"])


def test_bench_draft_pass_runs_and_reports(tmp_path):
    """benchmarks/bench_draft_pass.py: both paths timed, agreeing, written as JSON; bad flags refused."""
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_draft_pass.py")
    out = tmp_path / "dp.json"
    run = subprocess.run([sys.executable, bench, "--blocks", "2,4", "--steps", "3", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(out.read_text())
    for b in ("2", "4"):
        row = res["blocks"][b]
        assert row["same_proposals"] and row["max_abs_diff"] < 1e-4 and row["native_us"] > 0 and row["operators_us"] > 0
    bad = subprocess.run([sys.executable, bench, "--blocks", "x"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "error: --blocks" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rotary_that_follows_the_longest_position_stays_on_the_operators(pair, rope_type):
    """Dynamic and longrope frequencies change with the longest position seen, which a table by
    position cannot reproduce: such a draft is not run natively."""
    target, _, root = pair
    draft = load_draft(root / "draft", target)
    draft.rotary_emb.rope_type = rope_type
    assert not draft.use_native() and not draft.native
