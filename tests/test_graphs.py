"""offload/graphs.py: the segmented forward (static KV cache, explicit layer hooks) computes what
the ordinary forward computes. On the CPU the segments run eagerly; CUDA graph capture of the
same segments is exercised by the GPU benchmark (benchmarks/bench_offload_gpu.py --cuda-graphs)."""

import pytest
import torch

from pdflash import PdflashError
from pdflash.offload.config import ModelPreset
from pdflash.offload.generate import decode_one_token, generate, prefill
from pdflash.offload.graphs import GraphedDecoder
from pdflash.offload.runtime import OffloadedModel
from pdflash.offload.synthetic import write_checkpoint

TINY = ModelPreset.from_name("tiny")
PROMPT = [5, 77, 200, 31, 9, 100, 250, 17, 3, 44, 81, 90]  # longer than the sliding window (8)


@pytest.fixture(scope="module", params=[("tiny", dict(seed=12, dtype="float32")), ("tiny", dict(seed=13, mxfp4=True)),
                                        ("qwen3-tiny", dict(seed=14, dtype="float32"))], ids=["f32", "mxfp4", "qwen3-f32"])
def ckpt(request, tmp_path_factory):
    preset, kw = request.param
    return write_checkpoint(tmp_path_factory.mktemp("graphs") / "m", ModelPreset.from_name(preset), **kw)


@pytest.mark.parametrize("slots,prefetch", [(TINY.num_experts_per_tok, {"lookahead_depth": 1}), (None, {})])
def test_segmented_forward_matches_the_model(ckpt, slots, prefetch):
    with OffloadedModel.load(ckpt, expert_cache_experts=slots, **prefetch) as rt:
        want = generate(rt, PROMPT, max_new_tokens=14, eos_token_ids=[]).token_ids
        kv = rt.new_kv_cache()
        want_logits = prefill(rt, torch.tensor([PROMPT]), kv)
        want_next = decode_one_token(rt, int(want_logits.argmax()), kv)

        dec = GraphedDecoder(rt, max_len=32, graphs=False)
        logits = dec.prefill(PROMPT)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        toks = [int(logits.argmax())]
        nxt = dec.decode(toks[0])
        torch.testing.assert_close(nxt, want_next, rtol=1e-4, atol=1e-4)
        toks.append(int(nxt.argmax()))
        while len(toks) < 14:
            toks.append(int(dec.decode(toks[-1]).argmax()))
        assert toks == want
        assert rt.stats()["cache"]["hits"] + rt.stats()["cache"]["misses"] > 0  # the runtime's bookkeeping ran


def test_limits_and_cpu_graphs(ckpt):
    with OffloadedModel.load(ckpt) as rt:
        dec = GraphedDecoder(rt, max_len=len(PROMPT) + 1, graphs=False)
        dec.prefill(PROMPT)
        dec.decode(1)
        with pytest.raises(PdflashError, match="positions"):
            dec.decode(2)
        with pytest.raises(PdflashError, match="CUDA"):
            GraphedDecoder(rt, max_len=8, graphs=True)
        with pytest.raises(PdflashError, match="--cuda-graphs needs --device cuda"):
            generate(rt, PROMPT, max_new_tokens=2, cuda_graphs=True)


def test_cli_refuses_cuda_graphs_where_they_cannot_run(run, ckpt):
    code, _, err = run("generate", "hi", "--model", str(ckpt), "--device", "cpu", "--no-draft", "--cuda-graphs")
    assert code == 2 and "--cuda-graphs needs --device cuda" in err
    code, _, err = run("generate", "hi", "--cuda-graphs", "--device", "cpu")  # embedded pair: speculative
    assert code == 2 and "--cuda-graphs needs --device cuda" in err


def test_key_length_buckets():
    dec = GraphedDecoder.__new__(GraphedDecoder)  # bucket() needs only the two sizes
    dec.min_bucket, dec.max_len, dec.rows = 8, 40, None
    assert [dec.bucket(n) for n in (1, 8, 9, 16, 17, 32, 33, 40)] == [8, 8, 16, 16, 32, 32, 40, 40]
    dec.rows, dec.capacity = 4, 43  # fixed rows: every step attends to the whole cache
    assert {dec.bucket(n) for n in (1, 9, 40)} == {43}


@pytest.mark.gpu
@pytest.mark.parametrize("prepare", [True, False], ids=["prepared", "captured-on-first-decode"])
@pytest.mark.parametrize("min_bucket", [8, None], ids=["buckets-16-32-40", "one-bucket"])
def test_cuda_graphs_replay_what_the_segments_compute(ckpt, prepare, min_bucket):
    """On a GPU: graphed decoding gives the tokens and (within rounding) the logits of the same
    segments run eagerly, at the minimum cache with lookahead prefetch, also across key-length
    buckets (prompt 12 + 24 decode steps use buckets 16, 32 and 40)."""
    with OffloadedModel.load(ckpt, device="cuda", expert_cache_experts=TINY.num_experts_per_tok, lookahead_depth=1) as rt:
        def run(graphs):
            rt.reset_cache()
            dec = GraphedDecoder(rt, max_len=40, graphs=graphs, min_bucket=min_bucket)
            if prepare:
                dec.prepare(len(PROMPT))
            logits = [dec.prefill(PROMPT)]
            for _ in range(24):  # positions 12..35: keys 13..36
                logits.append(dec.decode(int(logits[-1].argmax())))
            return torch.cat(logits), rt.stats()["cache"], sorted(b for b, _ in dec._steps)

        want, want_cache, _ = run(False)
        got, got_cache, buckets = run(True)
        assert buckets == ([16, 32, 40] if min_bucket == 8 else [40])
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert got_cache["hits"] + got_cache["misses"] == want_cache["hits"] + want_cache["misses"]


def test_cli_graphs_default_off_where_they_do_not_apply(run, ckpt):
    import json

    code, out, err = run("generate", "hi", "--model", str(ckpt), "--device", "cpu", "--no-draft", "--json",
                         "--max-new-tokens", "3")
    assert code == 0, err
    assert json.loads(out)["cuda_graphs"] is False


@pytest.mark.gpu
def test_cli_graphs_on_by_default_on_cuda_with_the_same_tokens(run, ckpt):
    """`generate` on CUDA replays graphs unless told not to; greedy tokens equal the eager run."""
    import json

    args = ("generate", "hi there", "--model", str(ckpt), "--device", "cuda", "--no-draft", "--json",
            "--max-new-tokens", "12", "--expert-cache-experts", str(TINY.num_experts_per_tok), "--lookahead-depth", "1")
    code, out, err = run(*args)
    assert code == 0, err
    graphed = json.loads(out)
    code, out, err = run(*args, "--no-cuda-graphs")
    assert code == 0, err
    eager = json.loads(out)
    assert graphed["cuda_graphs"] is True and eager["cuda_graphs"] is False
    assert graphed["token_ids"] == eager["token_ids"]


def test_eager_forwards_attend_only_to_written_positions(ckpt):
    """A long max_len costs a prefill nothing: attention sees the positions written so far, and the
    logits do not depend on max_len."""
    with OffloadedModel.load(ckpt) as rt:
        short = GraphedDecoder(rt, max_len=len(PROMPT) + 2, graphs=False)
        want = short.prefill(PROMPT)
        long = GraphedDecoder(rt, max_len=4096, graphs=False)
        seen = []
        update = long.kv.update

        def spy(key, value, layer_idx, *a, **kw):
            k, v = update(key, value, layer_idx, *a, **kw)
            seen.append(k.shape[2])
            return k, v

        long.kv.update = spy
        got = long.prefill(PROMPT)
        assert set(seen) == {len(PROMPT)}
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        seen.clear()
        long.decode(int(got.argmax()))
        assert set(seen) == {len(PROMPT) + 1}


def test_a_static_cache_that_does_not_fit_is_a_clear_error(ckpt, monkeypatch):
    import pdflash.offload.graphs as graphs

    def no_room(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    monkeypatch.setattr(graphs, "StaticKV", no_room)
    with OffloadedModel.load(ckpt) as rt:
        with pytest.raises(PdflashError, match=r"static KV cache of 100000 positions \(.* GiB\) does not fit.*--no-cuda-graphs"):
            GraphedDecoder(rt, max_len=100_000, graphs=False)


def test_cli_reports_device_out_of_memory_in_one_line(run, ckpt, monkeypatch):
    import importlib

    gen = importlib.import_module("pdflash.offload.generate")  # the package exports a function of that name

    def no_room(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(gen, "prefill", no_room)
    code, out, err = run("generate", "hi", "--model", str(ckpt), "--device", "cpu", "--no-draft", "--no-live")
    assert code == 1 and out == ""
    assert err.strip().splitlines() == ["Error: the device ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB); "
                                        "give a smaller --expert-cache-mib or --max-new-tokens, or free the device"]


@pytest.mark.parametrize("slots", [TINY.num_experts_per_tok * 4, None])
def test_blocks_through_the_segments_match_the_model(ckpt, slots):
    """A T-token forward of the segmented decoder gives the logits and tapped layer outputs of
    the ordinary forward over the same block, and truncating drops rejected positions."""
    from pdflash.draft.speculative import crop_cache, new_target_cache, target_forward
    from pdflash.draft.taps import FeatureTap

    with OffloadedModel.load(ckpt, expert_cache_experts=slots, block_tokens=4) as rt:
        kv = new_target_cache()  # full-length layers: croppable
        taps = FeatureTap(rt.model, [0, 2])
        dec = GraphedDecoder(rt, max_len=40, graphs=False)
        dec.tap_layers = [0, 2]
        with taps.capture():
            want = target_forward(rt.model, torch.tensor([PROMPT]), 0, kv, logits_to_keep=1)
        want_f = taps.take()
        got, got_f = dec.prefill_with_features(PROMPT)
        torch.testing.assert_close(got, want[:, -1].float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_f, want_f, rtol=1e-4, atol=1e-4)
        pos = len(PROMPT)
        for block, keep in (([7, 8, 9, 10], 2), ([11], 1), ([12, 13, 14], 3), ([15, 16], 1)):
            with taps.capture():
                want = target_forward(rt.model, torch.tensor([block]), pos, kv)[0].float()
            want_f = taps.take()
            got, got_f = dec.forward(block)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got_f, want_f, rtol=1e-4, atol=1e-4)
            pos += keep
            crop_cache(kv, pos)
            dec.truncate(pos)
        assert dec.length == pos
        with pytest.raises(PdflashError, match="truncate"):
            dec.truncate(pos + 1)
        taps.close()


@pytest.mark.parametrize("predictor", ["previous", "lookahead+draft-router", "none"])
def test_speculative_decoding_through_the_decoder_is_lossless(tmp_path_factory, predictor):
    """Speculative decoding with every verify block run by the segmented decoder (the CUDA path,
    eager here) commits the target's greedy tokens, fixed and auto block sizes, route-ahead on."""
    from pdflash.draft import load_draft, speculative_generate, write_synthetic_draft
    from pdflash.draft.offloaded import make_planner
    from pdflash.draft.route_ahead import RouteAhead

    d = tmp_path_factory.mktemp("specgraphs")
    write_checkpoint(d / "t", TINY, mxfp4=True, dtype="bfloat16")
    write_synthetic_draft(d / "d", "tiny", target_dir=d / "t", seed=2)
    with OffloadedModel.load(d / "t", expert_cache_experts=12, block_tokens=4) as rt:
        want = generate(rt, PROMPT, max_new_tokens=24, eos_token_ids=[]).token_ids
        draft = load_draft(d / "d", rt.model)
        for auto in (False, True):
            rt.reset_cache()
            from pdflash.draft.speculative import make_oracle

            oracle = make_oracle(rt.model, PROMPT, 24, 0.8, reference=want, seed=3)
            ra = None if predictor == "none" else RouteAhead(rt.model, predictor, rt.prefetcher.prefetch_experts,
                                                               block_size=4, window_layers=2)
            planner = make_planner(rt, 4) if auto else None
            dec = GraphedDecoder(rt, max_len=len(PROMPT) + 24, graphs=False)
            try:
                res = speculative_generate(rt.model, draft, PROMPT, 24, block_size=4, oracle=oracle, route_ahead=ra,
                                           planner=planner, decoder=dec)
            finally:
                if ra is not None:
                    ra.close()
                if planner is not None:
                    rt.remove_routing_observer(planner.on_routed)
            assert res.token_ids == want and oracle.divergences == 0
            assert res.stats.acceptance_length > 1.0
            if ra is not None:
                assert res.route_ahead["steps"] > 0 and res.route_ahead["used"] > 0
            assert not rt.stats()["errors"]


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", ["auto", 4, 2])
def test_cuda_graphed_speculative_decoding_is_lossless(tmp_path_factory, block_size):
    """On a GPU: verify blocks replayed as CUDA graphs per block length, and the draft's passes
    replayed as graphs, commit the greedy tokens of the graphed plain decoder (float32: no
    rounding ties between block shapes)."""
    from pdflash.draft import load_draft, speculative_on_runtime, write_synthetic_draft

    d = tmp_path_factory.mktemp("cudaspec")
    write_checkpoint(d / "t", TINY, seed=21, dtype="float32")
    write_synthetic_draft(d / "d", "tiny", target_dir=d / "t", seed=2)
    with OffloadedModel.load(d / "t", device="cuda", expert_cache_experts=12, block_tokens=4) as rt:
        want = generate(rt, PROMPT, max_new_tokens=24, eos_token_ids=[], cuda_graphs=True).token_ids
        rt.reset_cache()
        draft = load_draft(d / "d", rt.model)
        res = speculative_on_runtime(rt, draft, PROMPT, 24, block_size=block_size, acceptance=0.8,
                                     eos_token_ids=[], graphs=True)  # reference from the graphed verify path
        assert res.token_ids == want and res.oracle["oracle_divergences"] == 0
        assert not rt.stats()["errors"]
        assert draft.graphed and draft._graphs.graphs and draft._graphs.replays > 0  # the draft's passes: graphs too


def test_no_cyclic_collection_runs_inside_a_capture_block():
    """Graph captures run with the cyclic collector off (a collection there may destroy another
    decoder's CUDA graphs, which fails the capture); it is back on after, also after an error, and
    stays off where the caller had it off."""
    import gc

    from pdflash.offload.graphs import no_collection

    assert gc.isenabled()
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), no_collection():
        raise ValueError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.gpu
def test_a_capture_survives_an_earlier_decoders_graphs_becoming_garbage(ckpt):
    """An earlier decoder whose captured graphs are only reachable through a reference cycle (as a
    closed runtime's shared decoders are), and a collector set to run at almost every allocation:
    the next decoder's captures still succeed and replay what the segments compute."""
    import gc

    with OffloadedModel.load(ckpt, device="cuda", expert_cache_experts=TINY.num_experts_per_tok) as rt:
        old = GraphedDecoder(rt, max_len=40, graphs=True)
        old.prepare(len(PROMPT), tokens=(1, 2))
        old.cycle = old  # garbage only the cyclic collector frees
        del old
        thresholds = gc.get_threshold()
        gc.set_threshold(1, 1, 1)
        try:
            dec = GraphedDecoder(rt, max_len=40, graphs=True)
            dec.prepare(len(PROMPT), tokens=(1, 2))
            got = [dec.prefill(PROMPT)]
            got.append(dec.decode(int(got[-1].argmax())))
        finally:
            gc.set_threshold(*thresholds)
        rt.reset_cache()
        eager = GraphedDecoder(rt, max_len=40, graphs=False)
        want = [eager.prefill(PROMPT)]
        want.append(eager.decode(int(want[-1].argmax())))
        assert torch.cat(got).argmax(-1).tolist() == torch.cat(want).argmax(-1).tolist()
