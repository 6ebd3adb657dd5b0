"""OffloadedModel: measurements, prefetch promotion and cancellation, hooks, KV cropping, lifecycle."""

import json
import threading

import pytest
import torch

from pdflash import PdflashError
from pdflash.native import Band
from pdflash.offload.config import ModelPreset
from pdflash.offload.generate import generate
from pdflash.offload.runtime import OffloadedModel
from pdflash.offload.synthetic import write_checkpoint
from references import gpt_oss_reference  # noqa: E402

TINY = ModelPreset.from_name("tiny")
E, K, L = TINY.num_local_experts, TINY.num_experts_per_tok, TINY.num_hidden_layers
PROMPT = [5, 77, 200, 31, 9, 100, 250, 17, 3, 44, 81, 90]



@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("rt") / "mx", TINY, seed=21, mxfp4=True)


@pytest.fixture(scope="module")
def ck_dense(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("rt") / "dense", TINY, seed=22)


def _run_with_deadline(fn, seconds=120):
    """Run fn in a thread; fail (instead of hanging the suite) if it does not finish in time."""
    err = []

    def target():
        try:
            fn()
        except BaseException as exc:  # re-raised below
            err.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"did not finish within {seconds} s (hang)"
    if err:
        raise err[0]


# -- exposed fetch -----------------------------------------------------------------------------------
def test_exposed_fetch_positive_with_slow_link_and_small_cache(ck):
    with OffloadedModel.load(ck, expert_cache_experts=K, link_gbps=0.02) as rt:
        generate(rt, PROMPT, max_new_tokens=6, eos_token_ids=[])
        st = rt.stats()
    assert st["exposed_fetch_seconds"] > 0
    assert st["exposed_fetch_by_band"]["on-demand"] == st["exposed_fetch_seconds"]
    assert st["exposed_fetch_by_band"]["route-ahead"] == 0.0 and st["exposed_fetch_by_band"]["background"] == 0.0
    assert sum(p["exposed_fetch_seconds"] for p in st["per_layer"]) == pytest.approx(st["exposed_fetch_seconds"])
    # no prefetch: every byte moved is a demand fetch of one whole expert
    assert st["cache"]["misses"] == st["demand_fetches"] > 0
    assert st["bytes_moved"] == st["demand_fetches"] * st["expert_bytes"]
    assert st["bands"][0]["bytes"] == st["bytes_moved"] and st["bands"][0]["stall_seconds"] > 0
    assert st["link_busy_seconds"] > 0
    assert st["bytes_per_token"] == st["bytes_moved"] / st["tokens"]


def test_exposed_fetch_zero_when_all_resident(ck):
    with OffloadedModel.load(ck, link_gbps=0.02, preload=True) as rt:
        before = rt.stats()
        assert before["exposed_fetch_seconds"] is None and before["cache"]["hit_rate"] is None  # nothing ran yet
        assert before["cache"]["resident"] == L * E and before["bytes_moved"] == 0
        generate(rt, PROMPT, max_new_tokens=6, eos_token_ids=[])
        st = rt.stats()
    assert st["exposed_fetch_seconds"] == 0.0
    assert st["cache"]["misses"] == 0 and st["cache"]["hit_rate"] == 1.0 and st["bytes_moved"] == 0


# -- prefetch ----------------------------------------------------------------------------------------
def test_queued_prefetch_is_promoted_not_fetched_twice_and_stale_ones_cancelled(ck):
    with OffloadedModel.load(ck, expert_cache_experts=L * E, link_gbps=0.001) as rt:
        # layer 0's copies queue behind the other layers' ones: still queued when the forward needs them
        n = rt.prefetcher.prefetch_experts({layer: range(E) for layer in range(1, L)}, priority=Band.BACKGROUND)
        n += rt.prefetcher.prefetch_experts({0: range(E)}, priority=Band.BACKGROUND)
        assert n == L * E
        rt.forward(torch.tensor([PROMPT[:1]]), cache=rt.new_kv_cache())
        st = rt.stats()
    c = st["cache"]
    assert c["hits"] + c["misses"] == L * K and c["misses"] == c["promoted"] > 0  # promoted in place
    assert st["demand_fetches"] == 0 and st["bands"][0]["submitted"] == 0  # never submitted again
    assert st["bands"][2]["submitted"] == L * E
    assert 0 < st["bands"][0]["promoted"] <= c["promoted"]
    assert st["exposed_fetch_by_band"]["background"] > 0  # the wait is charged to the band first asked for
    assert st["exposed_fetch_by_band"]["on-demand"] == 0.0
    assert st["prefetch"]["cancelled"] > 0  # layer 0's unused copies were cancelled once layer 1 started


def test_oracle_route_ahead_gives_all_hits(ck):
    """Prefetching exactly the experts a forward will use: every request hits, nothing is wasted."""
    ids = torch.tensor([PROMPT])
    with OffloadedModel.load(ck, expert_cache_experts=L * E) as rt:
        with rt.record_routing() as rec:
            rt.forward(ids, cache=rt.new_kv_cache())
        plan = rec.union()
        rt.reset_cache()
        n = rt.prefetcher.prefetch_experts(plan)
        rt.cache.drain()  # let every prefetch land before the forward
        assert all(rt.cache.is_resident(layer, e) for layer in plan for e in plan[layer])
        rt.forward(ids, cache=rt.new_kv_cache())
        st = rt.stats()
    assert n == sum(len(v) for v in plan.values())
    assert st["cache"]["misses"] == 0 and st["exposed_fetch_seconds"] == 0.0
    assert st["prefetch"]["used"] == n and st["prefetch"]["wasted"] == 0
    acc = st["prefetch"]["accuracy"]["route-ahead"]
    assert acc["recall"] == 1.0 and acc["precision"] == 1.0
    assert st["bands"][Band.ROUTE_AHEAD]["bytes"] == n * st["expert_bytes"]


def test_lookahead_and_history_predictions_are_scored(ck):
    with OffloadedModel.load(ck, expert_cache_experts=E, lookahead_depth=2, history_depth=2) as rt:
        with rt.record_routing() as rec:
            generate(rt, PROMPT, max_new_tokens=8, eos_token_ids=[])
        st = rt.stats()
    acc = st["prefetch"]["accuracy"]
    assert set(acc) == {"lookahead", "history"}
    for a in acc.values():
        assert a["predicted"] > 0 and 0 <= a["correct"] <= min(a["predicted"], a["used"])
        assert 0.0 <= a["recall"] <= 1.0 and 0.0 <= a["precision"] <= 1.0
    # lookahead predicts layers 1..L-1 of each forward: its "used" is their experts, counted from the recording
    assert acc["lookahead"]["used"] == sum(len(ex) for fwd in rec.forwards for layer, ex in fwd.items() if layer >= 1)
    assert st["prefetch"]["issued"]["route-ahead"] > 0 and st["prefetch"]["issued"]["background"] > 0


# -- hooks -------------------------------------------------------------------------------------------
def test_routing_record_matches_reference_router(ck_dense):

    ids = torch.tensor([PROMPT])
    ref = gpt_oss_reference(ck_dense, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = ref(ids, output_router_logits=True).router_logits
    want = {layer: sorted(set(torch.topk(lg, K, dim=-1).indices.reshape(-1).tolist())) for layer, lg in enumerate(logits)}
    seen = {}
    with OffloadedModel.load(ck_dense, expert_cache_experts=4) as rt:
        rt.add_routing_observer(lambda layer, ex: seen.__setitem__(layer, ex))
        with rt.record_routing() as rec:
            rt.forward(ids)
        assert rec.forwards == [want] and seen == want and rt.last_routing == want


def test_kv_cache_crop_like_speculative_decoding(ck_dense):
    """Crop the KV cache back and re-run: bit-identical to the library model doing the same."""
    from transformers import DynamicCache

    ids = torch.tensor([PROMPT])
    ref = gpt_oss_reference(ck_dense, dtype=torch.bfloat16)

    def run(forward):
        kv = DynamicCache()
        forward(ids[:, :8], kv)
        first = forward(ids[:, 8:12], kv)
        kv.crop(-4)  # drop the last 4 positions (negative crop works across transformers versions)
        assert kv.get_seq_length() == 8
        again = forward(ids[:, 8:12], kv)
        return first, again

    with OffloadedModel.load(ck_dense, expert_cache_experts=K) as rt:
        name = rt.family.cache_kwarg(ref)
        with torch.no_grad():
            r1, r2 = run(lambda x, kv: ref(x, use_cache=True, **{name: kv}).logits)
        g1, g2 = run(lambda x, kv: rt.forward(x, cache=kv).logits)
    assert torch.equal(g1, g2) and torch.equal(g1, r1) and torch.equal(r1, r2)


# -- sizing and lifecycle ----------------------------------------------------------------------------
def test_cache_below_minimum_is_a_clear_error(ck):
    with pytest.raises(PdflashError, match=r"holds 1 experts of .* the minimum is 2 "):
        OffloadedModel.load(ck, expert_cache_experts=1)
    with pytest.raises(PdflashError, match=r"the minimum is 6 .*top-2 x 3 token"):
        OffloadedModel.load(ck, expert_cache_experts=5, block_tokens=3)
    with pytest.raises(PdflashError, match=r"0.001 MiB holds 0 experts"):
        OffloadedModel.load(ck, expert_cache_mib=0.001)
    with pytest.raises(PdflashError, match="not both"):
        OffloadedModel.load(ck, expert_cache_mib=1, expert_cache_experts=4)
    with OffloadedModel.load(ck, expert_cache_experts=E, block_tokens=100) as rt:  # capped at E
        assert rt.cache.capacity == E


def test_cache_size_in_mib(ck):
    with OffloadedModel.load(ck, expert_cache_mib=0.1) as rt:
        assert rt.cache.capacity == int(0.1 * 2**20 // rt.cache.slot_bytes)


def test_the_link_probe_times_real_copies_and_leaves_the_cache_empty(ck):
    # the guard's order is timed on CUDA; the probe itself is the same on the memcpy backend
    with OffloadedModel.load(ck, expert_cache_experts=2 * E, link_gbps=0.05) as rt:
        assert rt.link_probe_bps is None  # a simulated link: its rate is the prior, nothing is probed
        rt.forget_costs()
        assert not rt.cost.link_measured
        rate = rt._probe_link(experts=4)
        assert rate is not None and rt.cost.link_measured and rt.cost.link_bytes_per_s == rate
        assert 0.03e9 < rate < 0.06e9  # the paced link: 50 MB/s
        assert all(not v for v in rt.resident_experts().values())
        st = rt.stats()
        assert st["bytes_moved"] == 0 and st["cache"]["misses"] == 0
        assert len(generate(rt, PROMPT, max_new_tokens=3).token_ids) == 3  # still usable


def test_reset_cache_a_hundred_times_without_hang(ck):
    def body():
        with OffloadedModel.load(ck, expert_cache_experts=8, link_gbps=0.01, lookahead_depth=1, history_depth=2) as rt:
            want = generate(rt, PROMPT, max_new_tokens=5, eos_token_ids=[]).token_ids
            for _ in range(100):
                rt.prefetcher.prefetch_experts({layer: range(E) for layer in range(L)}, priority=Band.BACKGROUND)
                rt.reset_cache()
                st = rt.stats()
                assert st["forwards"] == 0 and st["bytes_moved"] == 0 and st["cache"]["resident"] == 0
                assert st["bands"][2]["queue_depth"] == 0 and st["bands"][2]["in_flight"] == 0
            assert generate(rt, PROMPT, max_new_tokens=5, eos_token_ids=[]).token_ids == want

    _run_with_deadline(body)


def test_interrupted_forward_leaves_the_cache_usable(ck):
    """An exception in the middle of a layer (pins taken, copies in flight) does not wedge the cache."""
    with OffloadedModel.load(ck, expert_cache_experts=K, link_gbps=0.05) as rt:
        want = generate(rt, PROMPT, max_new_tokens=4, eos_token_ids=[]).token_ids
        rt.reset_cache()
        real_wait = rt.cache.wait

        def failing_wait(f):
            if f.layer == 2:  # e.g. Ctrl-C while blocked on a fetch of layer 2: its slots are pinned
                raise KeyboardInterrupt
            return real_wait(f)

        rt.cache.wait = failing_wait
        with pytest.raises(KeyboardInterrupt):
            rt.forward(torch.tensor([PROMPT]), cache=rt.new_kv_cache())
        rt.cache.wait = real_wait
        assert generate(rt, PROMPT, max_new_tokens=4, eos_token_ids=[]).token_ids == want


def test_close_is_terminal_and_idempotent(ck):
    rt = OffloadedModel.load(ck, expert_cache_experts=4)
    generate(rt, PROMPT, max_new_tokens=2, eos_token_ids=[])
    cache, host = rt.cache, rt.host
    rt.close()
    rt.close()
    assert cache.slots.numel() == 0 and host.buf.numel() == 0 and rt.scheduler is None and rt.model is None
    for call in (rt.stats, rt.reset_cache, lambda: rt.forward(torch.tensor([[1]]))):
        with pytest.raises(PdflashError, match="closed"):
            call()


def test_stats_are_plain_json(ck):
    with OffloadedModel.load(ck, expert_cache_experts=4, lookahead_depth=1) as rt:
        generate(rt, PROMPT, max_new_tokens=3, eos_token_ids=[])
        st = json.loads(json.dumps(rt.stats()))
    assert {"exposed_fetch_seconds", "cache", "bands", "prefetch", "per_layer", "bytes_moved", "link_busy_seconds"} <= set(st)
    assert [b["name"] for b in st["bands"]] == ["on-demand", "route-ahead", "background"]
    for b in st["bands"]:
        assert {"band", "submitted", "completed", "stall_seconds", "queue_wait_seconds", "bytes"} <= set(b)
    c = st["cache"]
    assert c["hit_rate"] == c["hits"] / (c["hits"] + c["misses"])
    assert c["resident"] + c["arriving"] + c["free"] == c["slots"] == 4
