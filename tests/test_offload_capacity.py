"""reset_cache(capacity_experts=N) on a runtime loaded with more slots behaves exactly like a
runtime loaded with N slots; the limit can be raised back (all resident) without reloading; the
scheduler trace option records every transfer."""

import time

import pytest

from pdflash import PdflashError
from pdflash.offload.config import ModelPreset
from pdflash.offload.generate import generate
from pdflash.offload.runtime import OffloadedModel
from pdflash.offload.synthetic import write_checkpoint

PROMPT = [3, 17, 41, 5, 99, 12, 7, 250, 31, 8, 64, 2]
ALL = 4 * 8  # tiny: 4 layers x 8 experts



@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("capacity") / "tiny"
    write_checkpoint(out, ModelPreset.from_name("tiny"), mxfp4=True, dtype="bfloat16")
    return out


def _counts(rt) -> dict:
    st = rt.stats()
    return {k: st["cache"][k] for k in ("hits", "misses", "evictions")} | {"demand": st["demand_fetches"],
                                                                          "bytes": st["bytes_moved"]}


def test_capacity_limit_matches_a_cache_of_that_size(ckpt):
    with OffloadedModel.load(ckpt, device="cpu", expert_cache_experts=5) as small:
        want = generate(small, PROMPT, max_new_tokens=12, eos_token_ids=[]).token_ids
        want_counts = _counts(small)
    with OffloadedModel.load(ckpt, device="cpu") as rt:
        assert rt.cache.n_slots == ALL
        rt.reset_cache(capacity_experts=5)
        assert rt.cache.capacity == 5 and rt.stats()["cache"]["slots"] == 5
        got = generate(rt, PROMPT, max_new_tokens=12, eos_token_ids=[]).token_ids
        assert got == want and _counts(rt) == want_counts
        assert sum(len(v) for v in rt.resident_experts().values()) <= 5
        rt.reset_cache()  # keeps the limit
        assert rt.cache.capacity == 5 and rt.resident_experts() == {}
        rt.reset_cache(capacity_experts=ALL)  # back to every slot, no reload
        assert rt.preload() == ALL
        generate(rt, PROMPT, max_new_tokens=12, eos_token_ids=[])
        assert rt.stats()["cache"]["misses"] == 0 and rt.stats()["exposed_fetch_seconds"] == 0.0


def test_capacity_bounds(ckpt):
    with OffloadedModel.load(ckpt, device="cpu", expert_cache_experts=10, block_tokens=2) as rt:
        with pytest.raises(PdflashError, match="between 4 .* and the 10 slots"):
            rt.reset_cache(capacity_experts=3)  # one layer of a 2-token block may need 2 x top-2
        with pytest.raises(PdflashError, match="between 4"):
            rt.reset_cache(capacity_experts=11)
        assert rt.cache.capacity == 10


def test_trace_records_each_transfer(ckpt):
    with OffloadedModel.load(ckpt, device="cpu", expert_cache_experts=6, link_gbps=0.05, trace=4096) as rt:
        t0 = time.monotonic()
        generate(rt, PROMPT, max_new_tokens=6, eos_token_ids=[])
        t1 = time.monotonic()
        recs = rt.scheduler.drain_trace()
        st = rt.stats()
        assert len(recs) == st["bands"][0]["completed"] == st["demand_fetches"]
        for r in recs:
            assert r["nbytes"] == st["expert_bytes"] and r["status"] == "done" and r["priority"] == 0
            assert t0 <= r["submit_s"] <= r["start_s"] <= r["end_s"] <= t1
        assert rt.scheduler.drain_trace() == []
