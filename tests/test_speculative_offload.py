"""Speculative decoding on the offloaded runtime: lossless greedy for bf16 and MXFP4 gpt-oss targets
and an FP8 Qwen3-MoE target at
several block sizes and expert-cache sizes (the minimum included), with route-ahead prefetches
going through the runtime's prefetcher."""

import json

import pytest
import torch

from pdflash import PdflashError
from pdflash.draft import (
    RouteAhead,
    draft_block_size,
    load_draft,
    make_oracle,
    speculative_generate,
    speculative_on_runtime,
    write_synthetic_draft,
)
from pdflash.offload.config import ModelPreset
from pdflash.offload.generate import generate
from pdflash.offload.runtime import OffloadedModel, min_cache_experts
from pdflash.offload.synthetic import write_checkpoint

PROMPT = [3, 17, 41, 5, 99, 12, 7, 250, 31, 8, 64, 2]  # longer than the tiny preset's window (8)
NEW = 30
BLOCK = 4  # the tiny draft's trained block size



@pytest.fixture(scope="module", params=["bf16", "mxfp4", "qwen3-fp8"])
def checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3-fp8":  # same expert counts as "tiny": the cache sizes below apply
        write_checkpoint(out / "target", ModelPreset.from_name("qwen3-tiny"), quant="fp8", dtype="bfloat16")
    else:
        write_checkpoint(out / "target", ModelPreset.from_name("tiny"), mxfp4=request.param == "mxfp4", dtype="bfloat16")
    write_synthetic_draft(out / "draft", "tiny", target_dir=out / "target", seed=2)
    return out


def cache_sizes():
    p = ModelPreset.from_name("tiny")
    least = min_cache_experts(p.num_local_experts, p.num_experts_per_tok, BLOCK)
    return [least, least + 5, p.num_hidden_layers * p.num_local_experts]


@pytest.mark.parametrize("slots", cache_sizes())
def test_lossless_on_the_offloaded_runtime(checkpoint, slots):
    with OffloadedModel.load(checkpoint / "target", device="cpu", expert_cache_experts=slots, block_tokens=BLOCK) as rt:
        want = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids
        draft = load_draft(checkpoint / "draft", rt.model)
        assert draft.embed_tokens is rt.model.model.embed_tokens
        for block in (2, BLOCK):
            rt.reset_cache()
            got = speculative_generate(rt.model, draft, PROMPT, NEW, block_size=block)
            assert got.token_ids == want, (block, slots)
        rt.reset_cache()
        oracle = make_oracle(rt.model, PROMPT, NEW, 0.7, reference=want, seed=slots)
        ra = RouteAhead(rt.model, "draft-router+previous", rt.prefetcher.prefetch_experts, block_size=BLOCK,
                        bytes_per_expert=rt.stats()["expert_bytes"], window_layers=2)
        try:
            got = speculative_generate(rt.model, draft, PROMPT, NEW, block_size=BLOCK, oracle=oracle, route_ahead=ra)
        finally:
            ra.close()
        assert got.token_ids == want
        assert got.stats.acceptance_length > 1.3 and oracle.divergences == 0
        stats = rt.stats()
        route_band = next(b for b in stats["bands"] if b["band"] == ra.priority)
        if slots < 32:  # all-resident caches fill on demand and leave nothing to prefetch later
            assert route_band["submitted"] > 0
        assert stats["prefetch"]["accuracy"]["route-ahead"]["predicted"] >= got.route_ahead["predicted"] > 0
        assert not stats["errors"]


@pytest.mark.parametrize("slots", cache_sizes())
def test_auto_block_size_is_lossless(checkpoint, slots, monkeypatch):
    """Lossless with route-ahead, in oracle mode and with the draft's own proposals; the plain steps
    the planner decides ahead (the cold start's among them) run as plain decoding runs."""
    from pdflash.draft.planner import BlockPlanner

    lean = []
    decide = BlockPlanner.decide_plain
    monkeypatch.setattr(BlockPlanner, "decide_plain", lambda self, *a, **k: decide(self, *a, **k) and not lean.append(1))
    with OffloadedModel.load(checkpoint / "target", device="cpu", expert_cache_experts=slots, block_tokens=BLOCK) as rt:
        want = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids
        draft = load_draft(checkpoint / "draft", rt.model)
        for predictor, acceptance in (("previous", None), ("none", 0.9), ("draft-router", 0.5)):
            rt.reset_cache()
            steps = []
            res = speculative_on_runtime(rt, draft, PROMPT, NEW, block_size="auto", predictor=predictor,
                                         acceptance=acceptance, reference=want, eos_token_ids=[], on_step=steps.append)
            assert res.token_ids == want, (slots, predictor)
            rep = res.to_dict()
            hist = rep["planner"]["block_histogram"]
            assert rep["block_histogram"] == hist and sum(hist.values()) == res.stats.verify_steps
            assert all(1 <= int(b) <= BLOCK for b in hist)
            assert rep["bytes_per_committed_token"] is not None and rep["planner"]["predicted_steps"] > 0
            assert not rt.stats()["errors"]
            assert lean, "no plain step was decided ahead"
            # every step's prediction reaches the caller (the live table), those decided ahead too
            assert sum(st.predicted_seconds is not None for st in steps) == rep["planner"]["predicted_steps"]
            lean.clear()


def test_shadow_probes_are_lossless_and_measure_what_the_draws_accept(tmp_path):
    """A link-bound target and a planner clock that makes every step 1 ms (so the choices do not
    depend on how busy the machine is): plain decoding is predicted far ahead of any block, the
    cold start's first look (step 3) is a shadow probe, and so is every later probe (every other
    step here): no block is ever verified. The output is plain greedy decoding, and the acceptance
    recorded follows the oracle's draws (all refused / all accepted) or the draft's own proposals."""
    import itertools

    write_checkpoint(tmp_path / "target", ModelPreset.from_name("tiny"), mxfp4=True, dtype="bfloat16")
    write_synthetic_draft(tmp_path / "draft", "tiny", target_dir=tmp_path / "target", seed=2)
    with OffloadedModel.load(tmp_path / "target", device="cpu", expert_cache_experts=12, block_tokens=BLOCK,
                             link_gbps=0.01) as rt:
        want = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids
        draft = load_draft(tmp_path / "draft", rt.model)
        first = {}
        for acceptance in (0.0, 1.0, None):
            rt.reset_cache()
            steps = []
            ticks = itertools.count(0.0, 0.0005)  # a step is one tick: its start and its end read it
            opts = {"probe_every": 2, "max_probe_interval": 2, "min_repeat_gap": 10**6, "clock": lambda: next(ticks)}
            res = speculative_on_runtime(rt, draft, PROMPT, NEW, block_size="auto", predictor="none",
                                         acceptance=acceptance, reference=want, eos_token_ids=[],
                                         planner_options=opts, on_step=steps.append)
            assert res.token_ids == want, acceptance
            plan = res.planner
            assert [s.shadow_block > 1 for s in steps[:3]] == [False, False, True]
            assert all(s.block_size == 1 and s.accepted == 0 for s in steps)
            assert sum(1 for s in steps if s.shadow_block) == plan["shadow_probes"] == plan["probes"] >= 3
            first[acceptance] = plan["acceptance_conditional"][0]
        assert first[0.0] < 0.3 and first[1.0] > 0.8  # from the prior 0.6, weight 4


def test_runtime_helper_oracle_mode_reports_only_the_speculative_run(checkpoint):
    block = draft_block_size(checkpoint / "draft", None)
    with OffloadedModel.load(checkpoint / "target", device="cpu", expert_cache_experts=12, block_tokens=block) as rt:
        want = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids
        rt.reset_cache()
        draft = load_draft(checkpoint / "draft", rt.model)
        res = speculative_on_runtime(rt, draft, PROMPT, NEW, acceptance=0.7, predictor="draft-router", eos_token_ids=[])
        assert res.token_ids == want
        d = res.to_dict()
        assert d["oracle_acceptance"] == 0.7 and d["route_ahead"]["predictor"] == "draft-router"
        assert rt.stats()["forwards"] == 1 + res.stats.verify_steps  # the reference run was reset away
        a = speculative_on_runtime(rt, draft, PROMPT, 12, temperature=0.9, seed=4, predictor=None, eos_token_ids=[])
        b = speculative_on_runtime(rt, draft, PROMPT, 12, temperature=0.9, seed=4, predictor=None, eos_token_ids=[])
        assert a.token_ids == b.token_ids and a.route_ahead is None
    for bad in (0, 5):
        with pytest.raises(PdflashError, match="block size 4"):
            draft_block_size(checkpoint / "draft", bad)


def test_benchmark_runs_every_arm_on_the_same_tokens(tmp_path):
    from pdflash.bench.speculative import main

    out = tmp_path / "bench.json"
    assert main(["--synthetic", "tiny", "--device", "cpu", "--max-new-tokens", "10", "--prompts", "1",
                 "--repeats", "1", "--predictors", "previous,none", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["oracle_acceptance"] == 0.7 and "Oracle-acceptance mode" in result["markdown"]
    assert {r["arm"] for r in result["runs"]} == {"plain", "spec:previous", "spec:none"}
    assert all(r["same_tokens_as_plain"] for r in result["runs"])
    assert result["summary"]["spec:previous"]["acceptance_length"] >= 1.0


@pytest.mark.parametrize("acceptance", [0.9, 0.5])
def test_oracle_acceptance_matches_its_expectation_without_repairs(checkpoint, acceptance):
    """bf16 and MXFP4 targets: the reference comes from the verify path (oracle_reference), so the
    committed tokens per verify pass follow 1 + P + P^2 + P^3 and nothing is repaired."""
    from pdflash.draft.offloaded import oracle_reference
    from pdflash.offload.graphs import GraphedDecoder

    new = 120
    expect = sum(acceptance ** i for i in range(BLOCK))
    with OffloadedModel.load(checkpoint / "target", device="cpu", expert_cache_experts=16, block_tokens=BLOCK) as rt:
        draft = load_draft(checkpoint / "draft", rt.model)
        res = speculative_on_runtime(rt, draft, PROMPT, new, block_size=BLOCK, acceptance=acceptance, predictor="none",
                                     eos_token_ids=[], seed=11)
        assert res.oracle["oracle_divergences"] == 0 and res.oracle["oracle_refreshes"] == 0
        # committed per verify pass: mean of ~40-90 draws with sd <= 1.2 -> within 0.45 at > 3 sd
        assert abs(res.stats.acceptance_length - expect) < 0.45, (res.stats.acceptance_length, expect)
        # the same through the segmented decoder (the CUDA path, eager here)
        dec = GraphedDecoder(rt, max_len=len(PROMPT) + new, graphs=False)
        ref = oracle_reference(rt, PROMPT, new, BLOCK, decoder=dec)
        rt.reset_cache()
        oracle = make_oracle(rt.model, PROMPT, new, acceptance, reference=ref, seed=11)
        got = speculative_generate(rt.model, draft, PROMPT, new, block_size=BLOCK, oracle=oracle, decoder=dec)
        assert got.token_ids == ref and oracle.divergences == 0 and oracle.refreshes == 0
        assert abs(got.stats.acceptance_length - expect) < 0.45


def test_generate_with_draft_on_a_cpu_runs_a_float32_draft_and_stays_lossless(checkpoint, monkeypatch):
    import pdflash.draft.model as model_mod
    from pdflash.draft import generate_with_draft

    dtypes = []
    real = model_mod.load_draft

    def spy(*args, **kwargs):
        d = real(*args, **kwargs)
        dtypes.append(d.fc.weight.dtype)
        return d

    monkeypatch.setattr(model_mod, "load_draft", spy)
    with OffloadedModel.load(checkpoint / "target", device="cpu", block_tokens=BLOCK) as rt:
        want = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids
        assert rt.model.lm_head.weight.dtype == torch.bfloat16  # the target computes in bf16
        rt.reset_cache()
        res, extra = generate_with_draft(rt, PROMPT, draft_dir=checkpoint / "draft", max_new_tokens=NEW, auto=True,
                                         predictor="none")
    assert dtypes == [torch.float32]
    assert res.token_ids[: len(want)] == want[: len(res.token_ids)] and extra["verify_steps"] > 0


def test_oracle_mode_gives_the_planner_no_repetition_hint(tmp_path, monkeypatch):
    """The oracle's proposals do not read the text, so where it repeats itself the planner gets no
    hint to probe early (it would verify blocks the draws then refuse); a real draft's run gets the
    hint. Here the repetition index says the text repeats before every step."""
    from pdflash.draft.offloaded import make_planner
    from pdflash.draft.speculative import RepeatIndex

    monkeypatch.setattr(RepeatIndex, "repeating", lambda self, tokens: True)
    write_checkpoint(tmp_path / "target", ModelPreset.from_name("tiny"), dtype="bfloat16")
    write_synthetic_draft(tmp_path / "draft", "tiny", target_dir=tmp_path / "target", seed=2)
    with OffloadedModel.load(tmp_path / "target", device="cpu", expert_cache_experts=12, block_tokens=BLOCK) as rt:
        want = generate(rt, PROMPT, max_new_tokens=16, eos_token_ids=[]).token_ids
        draft = load_draft(tmp_path / "draft", rt.model)
        hints = {}
        for mode in ("oracle", "draft"):
            rt.reset_cache()
            planner = make_planner(rt, BLOCK)
            seen = []
            plan, decide = planner.plan_draft, planner.decide_plain
            planner.plan_draft = lambda limit, repeating=False, **kw: seen.append(repeating) or plan(limit, repeating, **kw)
            planner.decide_plain = lambda limit, repeating=False: seen.append(repeating) or decide(limit, repeating)
            oracle = make_oracle(rt.model, PROMPT, 16, 0.5, reference=want) if mode == "oracle" else None
            try:
                res = speculative_generate(rt.model, draft, PROMPT, 16, planner=planner, oracle=oracle, eos_token_ids=[])
            finally:
                rt.remove_routing_observer(planner.on_routed)
            assert res.token_ids == want, mode
            hints[mode] = seen
        assert hints["oracle"] and not any(hints["oracle"])
        assert hints["draft"] and all(hints["draft"])


def test_overdrafted_blocks_stay_lossless_and_measure_past_the_block(tmp_path):
    """A planner whose home block is 2 drafts 4 positions per verified block of 2 (overdraft) on
    the offloaded tiny pair in oracle mode: the output is the target's own greedy output, the
    draft ran longer passes than the blocks it verified, and the acceptance model reached the
    positions past the block; with overdraft 1 nothing is drafted past a block."""
    from pdflash.draft.offloaded import make_planner

    write_checkpoint(tmp_path / "target", ModelPreset.from_name("tiny"), dtype="bfloat16")
    write_synthetic_draft(tmp_path / "draft", "tiny", target_dir=tmp_path / "target", seed=2)
    with OffloadedModel.load(tmp_path / "target", device="cpu", expert_cache_experts=12, block_tokens=BLOCK) as rt:
        want = generate(rt, PROMPT, max_new_tokens=24, eos_token_ids=[]).token_ids
        draft = load_draft(tmp_path / "draft", rt.model)
        drafted = []
        forward = draft.forward
        draft.forward = lambda ids, *a, **kw: drafted.append(int(ids.shape[-1])) or forward(ids, *a, **kw)
        for overdraft in (2.0, 1.0):
            rt.reset_cache()
            drafted.clear()
            planner = make_planner(rt, BLOCK, home_block=2, first_by_cost=False, overdraft=overdraft)
            oracle = make_oracle(rt.model, PROMPT, 24, 0.9, reference=want, seed=1)
            try:
                res = speculative_generate(rt.model, draft, PROMPT, 24, planner=planner, oracle=oracle, eos_token_ids=[])
            finally:
                rt.remove_routing_observer(planner.on_routed)
            assert res.token_ids == want and oracle.divergences == 0, overdraft
            verified = {int(b) for b in res.planner["block_histogram"] if int(b) > 1}
            if overdraft > 1:
                assert res.planner["overdrafted_blocks"] > 0 and max(drafted) > min(verified)
                assert planner.acceptance.reached[2] > 0  # position 3, past a block of 2
            else:
                assert res.planner["overdrafted_blocks"] == 0
