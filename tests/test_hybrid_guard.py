"""HybridGuard: a placement (arm) is kept only while decode steps realize it faster (offload/cpu_compute.py)."""

import pytest

from pdflash.offload.cpu_compute import GUARD_ARMS, HybridGuard, guard_order


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def run(guard, clock, steps, on_s, off_s, tokens=1):
    """``steps`` forwards of ``tokens`` tokens, each lasting on_s or off_s by the guard's mode."""
    modes = []
    for _ in range(steps):
        guard.on_forward(tokens)
        modes.append(guard.enabled)
        clock.t += on_s if guard.enabled else off_s
    return modes


@pytest.mark.parametrize("on_s,off_s,want", [(0.030, 0.040, True), (0.045, 0.040, False), (0.0400, 0.0401, False)])
def test_keeps_the_faster_mode(on_s, off_s, want):
    clock = Clock()
    g = HybridGuard(window=3, rounds=2, hold=10, arms=("off", "model"), clock=clock)
    run(g, clock, 1 + 3 * 4, on_s, off_s)  # the first forward has no predecessor; then four windows
    assert g.checks == 1 and g.enabled is want and g.arm == ("model" if want else "off")
    assert g.stats()["model_ms"] == pytest.approx(on_s * 1e3) and g.stats()["off_ms"] == pytest.approx(off_s * 1e3)


def test_windows_alternate_and_the_hold_doubles_when_confirmed():
    clock = Clock()
    g = HybridGuard(window=2, rounds=1, hold=4, max_hold=16, recheck=1.0, arms=("off", "model"), clock=clock)
    modes = run(g, clock, 1 + 4, 0.05, 0.04)
    assert modes == [False, False, True, True, False] and g.checks == 1 and not g.enabled
    held = run(g, clock, 4, 0.05, 0.04)
    assert held == [False] * 4 and g.checks == 1  # held (nothing re-measured), then the next check opens with "off"
    run(g, clock, 4, 0.05, 0.04)  # the second check confirms "off"
    assert g.checks == 2 and not g.enabled and g.hold == 8
    run(g, clock, 8 + 4, 0.05, 0.04)
    assert g.checks == 3 and g.hold == 16
    run(g, clock, 16 + 4, 0.05, 0.04)
    assert g.checks == 4 and g.hold == 16  # max_hold


def test_prefills_and_the_gaps_around_them_are_not_steps():
    clock = Clock()
    g = HybridGuard(window=2, rounds=1, hold=4, arms=("off", "model"), clock=clock, max_tokens=8)
    run(g, clock, 20, 0.01, 0.02, tokens=9)  # prefills: longer than the guard judges
    assert g.checks == 0 and not g.enabled  # no check completed: still "off", the first arm
    g.on_forward(1)
    clock.t += 100.0  # a forward of one token followed by a prefill: that gap is not a step
    run(g, clock, 1, 0.01, 0.02, tokens=9)
    assert g.checks == 0 and g.stats()["model_ms"] is None


def test_verify_blocks_are_steps_compared_at_their_own_size():
    """Speculative decoding: forwards of 5 tokens are judged like decode steps."""
    clock = Clock()
    g = HybridGuard(window=2, rounds=1, hold=4, arms=("off", "model"), clock=clock)
    run(g, clock, 1 + 2 * 2, 0.01, 0.02, tokens=5)
    assert g.checks == 1 and g.arm == "model" and g.stats()["model_ms"] == pytest.approx(10)


def test_arms_are_compared_at_the_token_counts_they_share():
    """An arm whose windows happened to run longer blocks is not judged slower for it: steps are
    compared at equal token counts, and a round with none shared does not end the check."""
    clock = Clock()
    g = HybridGuard(window=3, rounds=1, hold=8, arms=("off", "model"), clock=clock)
    # step seconds by (arm, tokens): model is 20 % faster at every size
    cost = {("off", 1): 0.040, ("off", 4): 0.080, ("model", 1): 0.032, ("model", 4): 0.064}
    # off's windows run blocks of 1, model's blocks of 4: nothing shared, the check goes on
    sizes = {"off": 1, "model": 4}
    g.on_forward(sizes[g.arm])
    for _ in range(2 * 3):
        clock.t += cost[(g.arm, sizes[g.arm])]
        g.on_forward(sizes[g.arm])
    assert g.checks == 0
    # then both arms run both sizes: model's pooled median would be slower (more long blocks), its
    # per-size medians are faster
    sizes = {"off": 1, "model": 1}
    for _ in range(2 * 3):
        clock.t += cost[(g.arm, sizes[g.arm])]
        g.on_forward(sizes[g.arm])
    assert g.checks == 1 and g.arm == "model"
    assert g.stats()["model_ms"] < g.stats()["off_ms"]


def test_first_step_of_a_window_is_not_counted():
    clock = Clock()
    g = HybridGuard(window=2, rounds=1, hold=4, arms=("off", "model"), clock=clock, switch_abandon=None)
    g.on_forward(1)
    for seconds in (9.0, 0.04, 9.0, 0.03):  # a slow switch step opens each window (off, then model)
        clock.t += seconds
        g.on_forward(1)
    assert g.checks == 1 and g.stats()["model_ms"] == pytest.approx(30) and g.stats()["off_ms"] == pytest.approx(40)


def test_a_pinned_arm_is_kept_and_nothing_is_checked():
    clock = Clock()
    g = HybridGuard(window=2, rounds=1, hold=4, clock=clock)
    g.pin("host")
    assert run(g, clock, 50, 0.01, 0.02) == [True] * 50 and g.arm == "host" and g.checks == 0
    with pytest.raises(ValueError):
        g.pin("gpu")
    g.unpin()  # checking again from the first arm, as a new guard
    modes = run(g, clock, 2 * 4 + 1, 0.01, 0.02)  # off's window first, then the host arms' (all faster)
    assert modes[:2] == [False, False] and all(modes[2:]) and g.checks == 1 and g.arm == "all"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        HybridGuard(window=1)
    with pytest.raises(ValueError):
        HybridGuard(cut=-0.1)
    with pytest.raises(ValueError):
        HybridGuard(recheck=-0.1)
    for arms in (("model", "host"), ("off",), ("off", "off"), ("off", "gpu")):
        with pytest.raises(ValueError):
            HybridGuard(arms=arms)


def steps_by_arm(g, clock, ms, n, opening=True):
    """n decode steps, each lasting ms[arm] milliseconds for the guard's arm; the arms in order.
    With ``opening``, one forward first (a step of no time when steps ran before)."""
    arms = []
    if opening:
        g.on_forward(1)
    for _ in range(n):
        arms.append(g.arm)
        clock.t += ms[g.arm] / 1e3
        g.on_forward(1)
    return arms


@pytest.mark.parametrize("ms,want", [({"model": 40, "off": 45, "host": 30, "all": 41}, "host"),
                                     ({"model": 30, "off": 45, "host": 40, "all": 41}, "model"),
                                     ({"model": 41, "off": 45, "host": 40, "all": 30}, "all"),
                                     ({"model": 44.5, "off": 45, "host": 44.2, "all": 44.9}, "off"),  # within the margin
                                     ({"model": 50, "off": 45, "host": 60, "all": 47}, "off")])
def test_four_arms_keep_the_fastest(ms, want):
    clock = Clock()
    g = HybridGuard(window=2, rounds=2, hold=8, cut=1.0, clock=clock)  # no arm is cut: two full rounds
    arms = steps_by_arm(g, clock, ms, 4 * 2 * 2)  # four arms, two rounds, windows of two steps
    assert arms == (["off"] * 2 + ["all"] * 2 + ["model"] * 2 + ["host"] * 2) * 2
    assert g.checks == 1 and g.arm == want and g.enabled is (want != "off")
    assert {a: g.stats()[f"{a}_ms"] for a in ms} == pytest.approx(ms)


def test_arms_far_behind_leave_after_a_round():
    clock = Clock()
    g = HybridGuard(window=2, rounds=3, hold=8, cut=0.05, clock=clock)
    ms = {"off": 45, "all": 30, "model": 31, "host": 40}  # after round one, only all and model are within 5 %
    arms = steps_by_arm(g, clock, ms, 2 * 4 + 2 * 2 * 2)
    assert arms == ["off"] * 2 + ["all"] * 2 + ["model"] * 2 + ["host"] * 2 + (["all"] * 2 + ["model"] * 2) * 2
    assert g.checks == 1 and g.arm == "all"
    # the arms that left keep their first-round medians in the report
    assert g.stats()["off_ms"] == pytest.approx(45) and g.stats()["host_ms"] == pytest.approx(40)


def test_a_check_ends_when_one_arm_is_left():
    clock = Clock()
    g = HybridGuard(window=2, rounds=4, hold=8, cut=0.05, clock=clock)
    arms = steps_by_arm(g, clock, {"off": 45, "all": 20, "model": 31, "host": 40}, 2 * 4)
    assert arms == ["off"] * 2 + ["all"] * 2 + ["model"] * 2 + ["host"] * 2
    assert g.checks == 1 and g.arm == "all"  # one round was enough
    # held: the opening forward ends one held step, seven more follow
    assert steps_by_arm(g, clock, {"off": 45, "all": 20, "model": 31, "host": 40}, 7) == ["all"] * 7


def test_off_is_kept_when_the_host_arms_are_cut():
    clock = Clock()
    g = HybridGuard(window=2, rounds=2, hold=8, cut=0.05, clock=clock)
    steps_by_arm(g, clock, {"off": 30, "all": 45, "model": 40, "host": 50}, 2 * 4)
    assert g.checks == 1 and g.arm == "off" and not g.enabled


def test_a_recheck_tries_only_the_arms_measured_near_the_best():
    clock = Clock()
    g = HybridGuard(window=2, rounds=2, hold=4, cut=0.05, recheck=0.25, clock=clock)
    ms = {"off": 45, "all": 30, "model": 35, "host": 40}
    steps_by_arm(g, clock, ms, 2 * 4)  # the first check: one round, only "all" within 5 %
    assert g.checks == 1 and g.full_checks == 1 and g.arm == "all"
    # held 4 steps (the opening forward ends the first), then the re-check: the kept arm first,
    # then "model" (35 <= 30 * 1.25); off and host were far behind and are not tried again
    arms = steps_by_arm(g, clock, ms, 3 + 2 * 2)
    assert arms == ["all"] * 3 + ["all"] * 2 + ["model"] * 2
    assert g.checks == 2 and g.full_checks == 1 and g.arm == "all" and g.hold == 8  # confirmed: the hold doubles
    assert g.stats()["off_ms"] == pytest.approx(45) and g.stats()["model_ms"] == pytest.approx(35)


def test_a_slower_recheck_measures_every_arm_again():
    clock = Clock()
    g = HybridGuard(window=2, rounds=2, hold=4, cut=0.05, recheck=0.25, clock=clock)
    ms = {"off": 45, "all": 30, "model": 35, "host": 40}
    steps_by_arm(g, clock, ms, 2 * 4 + 3)  # the first check ("all"), then its hold
    slow = {"off": 45, "all": 60, "model": 70, "host": 40}  # the host became busy, say
    arms = steps_by_arm(g, clock, slow, 2 * 2)  # the re-check: "all" and "model", both far slower (model cut)
    assert arms == ["all"] * 2 + ["model"] * 2
    assert g.checks == 2 and g.hold == 4  # not confirmed: the hold starts over
    arms = steps_by_arm(g, clock, slow, 2 * 4, opening=False)  # a full check follows at once
    assert arms == ["off"] * 2 + ["all"] * 2 + ["model"] * 2 + ["host"] * 2
    assert g.checks == 3 and g.full_checks == 2 and g.arm == "host"


# step times of the guard's arms measured on a GPU host (gpt-oss-120b shape, session 23)
MEASURED_MS = {"all": 32.6, "host": 38.0, "model": 56.0, "off": 101.0}


def test_an_arm_far_behind_costs_two_steps_not_a_window():
    clock = Clock()
    g = HybridGuard(window=4, rounds=2, hold=64, arms=("all", "host", "model", "off"), clock=clock)
    arms = steps_by_arm(g, clock, MEASURED_MS, 4 + 4 + 2 + 2)
    # model (56 > 1.5 x 32.6) and off leave after their first counted step; host (38) runs its
    # window, is cut at the round's end (more than 5 % behind), and the check ends
    assert arms == ["all"] * 4 + ["host"] * 4 + ["model"] * 2 + ["off"] * 2
    assert g.checks == 1 and g.arm == "all" and g.abandoned == 2
    assert {a: g.stats()[f"{a}_ms"] for a in MEASURED_MS} == pytest.approx(MEASURED_MS)
    assert g.stats()["abandoned_windows"] == 2
    # the re-check after the hold tries only "host" beside the kept arm (the others were far behind)
    arms = steps_by_arm(g, clock, MEASURED_MS, 63 + 4 + 4)
    assert arms == ["all"] * 63 + ["all"] * 4 + ["host"] * 4 and g.checks == 2 and g.arm == "all"


def test_without_abandon_every_window_runs_in_full():
    clock = Clock()
    g = HybridGuard(window=4, rounds=2, hold=64, arms=("all", "host", "model", "off"), clock=clock, abandon=None)
    arms = steps_by_arm(g, clock, MEASURED_MS, 16)
    assert arms == ["all"] * 4 + ["host"] * 4 + ["model"] * 4 + ["off"] * 4
    assert g.checks == 1 and g.arm == "all" and g.abandoned == 0


def test_the_first_arm_far_behind_is_measured_in_full_and_the_rest_are_not_abandoned():
    """Only an arm behind one already measured leaves early: a slow first arm runs its window."""
    clock = Clock()
    g = HybridGuard(window=3, rounds=1, hold=8, clock=clock)  # off first
    arms = steps_by_arm(g, clock, {"off": 90, "all": 30, "model": 40, "host": 44}, 3 * 4)
    assert arms == ["off"] * 3 + ["all"] * 3 + ["model"] * 3 + ["host"] * 3
    assert g.abandoned == 0 and g.arm == "all"


def test_abandon_compares_steps_of_the_same_token_count():
    """A verify block of 5 tokens is not abandoned for being slower than another arm's 1-token steps."""
    clock = Clock()
    g = HybridGuard(window=3, rounds=1, hold=8, arms=("all", "off"), clock=clock)
    cost = {("all", 1): 0.030, ("all", 5): 0.060, ("off", 1): 0.035, ("off", 5): 0.070}
    sizes = {"all": 1, "off": 5}
    g.on_forward(1)
    seen = []
    for _ in range(3 + 3):
        seen.append(g.arm)
        clock.t += cost[(g.arm, sizes[g.arm])]
        g.on_forward(sizes[g.arm])
    assert seen == ["all"] * 3 + ["off"] * 3 and g.abandoned == 0


def test_steps_right_after_a_prefill_settle_uncounted_under_the_first_arm():
    clock = Clock()
    g = HybridGuard(window=2, rounds=1, hold=8, arms=("all", "off"), clock=clock, settle=3, trace=16)
    g.on_forward(20)  # a prefill
    # the prefill's own interval is no step; then three settle, then a window of each arm
    arms = steps_by_arm(g, clock, {"all": 30, "off": 40}, 1 + 3 + 2 * 2, opening=False)
    assert arms == ["all"] * (1 + 3 + 2) + ["off"] * 2
    assert [w for _, _, _, w in g.trace] == ["settling"] * 3 + ["switch", "counted"] * 2
    assert g.checks == 1 and g.arm == "all"
    # a later prefill during the hold: its settle steps pass while held, nothing is skipped after
    g.on_forward(20)
    steps_by_arm(g, clock, {"all": 30, "off": 40}, 7, opening=False)
    assert [w for _, _, _, w in g.trace[7:]] == ["held"] * 6 and g._settling == 0
    assert HybridGuard(trace=4).trace == [] and HybridGuard().trace_limit == 0


def test_settled_steps_are_not_measured():
    """Slow steps right after a prefill do not count against the arm that runs them."""
    clock = Clock()
    g = HybridGuard(window=2, rounds=1, hold=8, arms=("all", "off"), clock=clock, settle=2)
    g.on_forward(20)
    for seconds in (0.5, 0.09):  # the prefill, then a slow step: settling
        clock.t += seconds
        g.on_forward(1)
    steps_by_arm(g, clock, {"all": 90, "off": 40}, 1, opening=False)  # slow, settling too
    steps_by_arm(g, clock, {"all": 30, "off": 40}, 4, opening=False)
    assert g.stats()["all_ms"] == pytest.approx(30) and g.arm == "all"


def test_a_bad_abandon_setting_is_refused():
    with pytest.raises(ValueError):
        HybridGuard(abandon=-0.1)
    with pytest.raises(ValueError):
        HybridGuard(settle=-1)
    with pytest.raises(ValueError):
        HybridGuard(switch_abandon=0.5)


def test_guard_order_puts_the_host_arms_first_unless_the_link_clearly_beats_the_kernel():
    assert guard_order(0.2e-3, 0.5e-3) == ("all", "host", "model", "off")
    assert guard_order(0.2e-3, 0.5e-3, host_steps=True) == ("host", "all", "model", "off")
    # with host steps a near tie (the kernel up to HOST_FIRST_FACTOR x slower an expert than the link)
    # keeps the host arms first
    assert guard_order(0.6e-3, 0.5e-3, host_steps=True) == ("host", "all", "model", "off")
    assert guard_order(0.99e-3, 0.5e-3, host_steps=True) == ("host", "all", "model", "off")
    assert guard_order(1.1e-3, 0.5e-3, host_steps=True) == GUARD_ARMS
    # the CPU device (a direct call) as with host steps, "all" leading
    assert guard_order(0.99e-3, 0.5e-3) == ("all", "host", "model", "off")
    assert guard_order(1.1e-3, 0.5e-3) == GUARD_ARMS
    # segmented on a GPU (a hand-off per layer the rates do not see): the kernel twice as fast an expert
    assert guard_order(0.24e-3, 0.5e-3, segmented=True) == ("all", "host", "model", "off")
    assert guard_order(0.26e-3, 0.5e-3, segmented=True) == GUARD_ARMS
    assert guard_order(0.49e-3, 0.5e-3, segmented=True) == GUARD_ARMS
    assert guard_order(0.6e-3, 0.5e-3, host_steps=True, segmented=True) == ("host", "all", "model", "off")
    assert guard_order(None, 0.5e-3) == GUARD_ARMS  # not calibrated: fetch-only first
    assert sorted(guard_order(0.2e-3, 0.5e-3)) == sorted(GUARD_ARMS)


def test_placement_sends_nothing_to_the_cpu_while_the_guard_is_off(tmp_path):
    """The runtime's placer consults the guard: off -> every miss is fetched."""
    import torch

    from pdflash.offload.config import ModelPreset
    from pdflash.offload.generate import generate
    from pdflash.offload.runtime import OffloadedModel
    from pdflash.offload.synthetic import write_checkpoint

    tiny = ModelPreset.from_name("tiny")
    path = write_checkpoint(tmp_path / "m", tiny, mxfp4=True, seed=3, progress=False)
    with OffloadedModel.load(path, dtype=torch.float32, cpu_experts="auto", expert_cache_experts=tiny.num_experts_per_tok,
                             link_gbps=0.01, cpu_threads=1) as rt:
        guard = rt.placer.guard
        assert guard is not None and guard.on_forward in rt._forward_observers
        guard.pin("off")  # as if a check had found the host path slower
        generate(rt, [1, 2, 3], max_new_tokens=4, eos_token_ids=[])
        # the planner's price of a missing expert follows: its fetch while "off", the host's otherwise
        assert rt.cost.placement_of(1) == "off" and rt.cost.placement_of(64) == "model"  # a prefill: the split
        assert rt.cost.seconds_per_missing_expert(1) == rt.cost.seconds_per_expert_fetch()
        assert rt.stats()["cpu_experts"]["computed"] == 0 and rt.stats()["cpu_experts"]["guard"]["host_path"] is False
        rt.reset_cache()
        guard.pin("host")  # every miss on the CPU: nothing fetched, not even hot experts in the background
        background = rt.placer.background
        host_tokens = generate(rt, [1, 2, 3, 1, 2, 3], max_new_tokens=8, eos_token_ids=[]).token_ids
        assert rt.placer.background == background
        st = rt.stats()
        assert st["cpu_experts"]["computed"] > 0 and st["cpu_experts"]["guard"]["arm"] == "host"
        assert rt.cost.placement_of(1) == "host"
        assert rt.cost.seconds_per_missing_expert(1) == rt.placer.runner.seconds_for(1)
        rt.forget_costs()  # the measurements go, the host path and its placement stay
        assert rt.cost.placement_of(1) == "host" and rt.cost.cpu_expert_seconds is not None
        assert st["experts_per_token"]["fetched"] == 0, st["experts_per_token"]
        rt.reset_cache()
        guard.pin("all")  # every routed expert on the CPU: no lookups, so no hits either
        assert generate(rt, [1, 2, 3, 1, 2, 3], max_new_tokens=8, eos_token_ids=[]).token_ids == host_tokens
        st = rt.stats()
        assert st["cpu_experts"]["guard"]["arm"] == "all" and st["cpu_experts"]["computed"] > 0
        assert st["experts_per_token"]["fetched"] == 0 and st["experts_per_token"]["cache"] == 0, st["experts_per_token"]


def test_longer_forwards_than_it_judges_take_the_cost_models_split():
    """The arm rules forwards up to max_tokens (decode steps, verify blocks); a prefill is priced
    by the cost model, whichever arm decode steps keep."""
    g = HybridGuard(max_tokens=8)
    for arm in ("off", "all", "host", "model"):
        g.pin(arm)
        assert g.arm_for(1) == arm and g.arm_for(8) == arm
        assert g.arm_for(9) == "model"
    g.pin("off", longer=True)  # fetch-only throughout: prefills too
    assert g.arm_for(1) == g.arm_for(9) == "off"
    g.unpin()
    assert g.arm_for(9) == "model"
    with pytest.raises(ValueError):
        HybridGuard(max_tokens=0)


def test_a_prefill_under_the_all_arm_is_split_by_the_cost_model(tmp_path):
    """In the runtime: with the guard on "all", a forward the guard judges takes the all path (the
    placer is not asked); a longer one (here a 6-token prefill with max_tokens 2) is placed by the
    cost model, layer by layer; the tokens stay the same either way."""
    import torch

    from pdflash.offload.config import ModelPreset
    from pdflash.offload.generate import generate
    from pdflash.offload.runtime import OffloadedModel
    from pdflash.offload.synthetic import write_checkpoint

    tiny = ModelPreset.from_name("tiny")
    path = write_checkpoint(tmp_path / "m", tiny, mxfp4=True, seed=3, progress=False)
    prompt = [1, 2, 3, 1, 2, 3]
    with OffloadedModel.load(path, dtype=torch.float32, cpu_experts="auto", expert_cache_experts=tiny.num_experts_per_tok,
                             link_gbps=0.01, cpu_threads=1) as rt:
        guard = rt.placer.guard
        guard.pin("all")
        before = rt.placer.decisions
        judged = generate(rt, prompt, max_new_tokens=4, eos_token_ids=[]).token_ids
        assert rt.placer.decisions == before  # prefill and decode steps: all path
        rt.reset_cache()
        guard.max_tokens = 2
        before = rt.placer.decisions
        split = generate(rt, prompt, max_new_tokens=4, eos_token_ids=[]).token_ids
        assert rt.placer.decisions - before == tiny.num_hidden_layers  # the prefill's layers asked the cost model
        assert split == judged


def test_the_gap_between_two_sequences_is_no_step(tmp_path):
    """A new sequence (rt.new_kv_cache, or a graphed decoder's prefill) tells the guard: the time
    since the last sequence's last forward is not measured as a step, and its first steps settle."""
    import torch

    from pdflash.offload.config import ModelPreset
    from pdflash.offload.generate import generate
    from pdflash.offload.runtime import OffloadedModel
    from pdflash.offload.synthetic import write_checkpoint

    tiny = ModelPreset.from_name("tiny")
    path = write_checkpoint(tmp_path / "m", tiny, mxfp4=True, seed=3, progress=False)
    with OffloadedModel.load(path, dtype=torch.float32, cpu_experts="auto", expert_cache_experts=tiny.num_experts_per_tok,
                             link_gbps=0.01, cpu_threads=1) as rt:
        guard = rt.placer.guard
        guard.trace_limit, guard.settle = 64, 2
        guard.short_steps = guard.min_steps  # short sequences are checked too (no first-arm exemption left)
        generate(rt, [1, 2, 3], max_new_tokens=3, eos_token_ids=[])
        first = list(guard.trace)
        assert [w for *_, w in first[:2]] == ["settling"] * 2
        guard.clock = lambda: 1e9  # a gap of "years" before the next sequence
        generate(rt, [1, 2, 3], max_new_tokens=1, eos_token_ids=[])
        assert guard.trace[len(first):] == []  # the prompt forward opens the sequence: nothing measured


def test_on_sequence_forgets_the_last_forward():
    clock = Clock()
    g = HybridGuard(window=2, rounds=1, hold=8, arms=("all", "off"), clock=clock, settle=0, trace=8)
    g.on_forward(1)
    clock.t += 100.0
    g.on_sequence()
    g.on_forward(1)
    assert g.trace == []


def test_a_short_sequence_runs_the_first_arm_unchecked_until_short_ones_add_up():
    """A sequence announced shorter than a check (min_steps) keeps the first arm, its steps traced
    as unchecked; once short sequences have run min_steps steps in all, the check runs across
    them and completes as in one long sequence; after a completed check, and for long, unknown
    or pinned sequences, nothing is exempt."""
    clock = Clock()
    arms = ("all", "host", "model", "off")
    ms = {"all": 0.020, "host": 0.030, "model": 0.040, "off": 0.050}
    g = HybridGuard(window=2, rounds=1, settle=1, arms=arms, clock=clock, trace=200)
    assert g.min_steps == 2 * (1 + 2 * 4)

    def sequence(steps):
        g.on_sequence(steps)
        used = []
        for _ in range(steps):
            g.on_forward(1)
            used.append(g.arm)
            clock.t += ms[g.arm]
        return used

    used = sequence(8) + sequence(8) + sequence(8)  # 7 steps each (the first forward follows no step)
    assert used == ["all"] * 24 and g.short_steps == 21 and g.checks == 0
    assert [what for *_, what in g.trace] == ["unchecked"] * 21
    assert g.stats()["unchecked_steps"] == 21
    while g.checks == 0 and len(used) < 200:  # short_steps >= min_steps: checked across sequences
        used += sequence(8)
        assert not g.short
    assert g.checks == 1 and g.arm == "all" and set(used[24:]) == set(arms) and g.short_steps == 21
    g.on_sequence(4)  # a check has completed
    assert not g.short
    g = HybridGuard(window=2, rounds=1, settle=1, arms=arms, clock=clock)
    for steps in (100, None):
        g.on_sequence(steps)
        assert not g.short
    g.on_sequence(3)
    assert g.short and g.arm == "all" and g.stats()["short_sequence"]
    g.on_sequence(100)  # back to the check where it stood
    assert not g.short and g.arm == "all"
    g.pin("off")
    g.on_sequence(3)
    assert not g.short and g.arm == "off"


def test_host_placements_lists_every_arm_a_step_may_take(tmp_path):
    """What graphs.py captures before a sequence: every placement of the guard's arms while it
    checks (segments for off, host steps for all, host and model: "split"), the pinned one once pinned."""
    import torch

    from pdflash.offload.config import ModelPreset
    from pdflash.offload.runtime import OffloadedModel
    from pdflash.offload.synthetic import write_checkpoint

    tiny = ModelPreset.from_name("tiny")
    path = write_checkpoint(tmp_path / "m", tiny, mxfp4=True, seed=3, progress=False)
    with OffloadedModel.load(path, dtype=torch.float32, cpu_experts="auto", expert_cache_experts=tiny.num_experts_per_tok,
                             link_gbps=0.01, cpu_threads=1) as rt:
        guard = rt.placer.guard
        assert sorted(rt.host_placements(1), key=str) == sorted([None, "all", "host", "split"], key=str)
        assert rt.host_placements(guard.max_tokens + 1) == [None]  # a prefill: the cost model's split
        guard.pin("host")
        assert rt.host_placements(1) == ["host"] and guard.pinned
        guard.pin("model")
        assert rt.host_placements(1) == ["split"]
        guard.pin("off")
        assert rt.host_placements(1) == [None]


def test_fetch_plan_is_the_cost_models_split_for_each_miss_count():
    """A split host step's plan: for M misses of one token each (decode), the experts the cost
    model's per-layer split fetches; here an expert costs 0.2 ms on the host and 0.26 ms over the
    link (13 MB at 50 GB/s), so the link takes one of 2-3 misses and two of 4, capped by the stages."""
    from types import SimpleNamespace

    from pdflash.offload.cost import CostModel
    from pdflash.offload.cpu_compute import CpuPlacement

    cost = CostModel(13_000_000, link_gbps=50.0)
    host_s = [2e-4]
    runner = SimpleNamespace(seconds_for=lambda tokens: host_s[0])
    sched = SimpleNamespace(stats=lambda: {})
    cost.observe_scheduler = lambda stats: None  # no link counters here: the simulated link's rate
    placer = CpuPlacement(SimpleNamespace(stats=SimpleNamespace(forwards=0)), sched, runner, cost)
    assert placer.fetch_plan(1, 4, 8) == [0, 0, 1, 1, 2]
    assert placer.fetch_plan(1, 4, 1) == [0, 0, 1, 1, 1]  # one stage
    host_s[0] = 1e-3  # a slow host: the link takes more
    assert placer.fetch_plan(1, 4, 8) == [0, 1, 2, 3, 3]  # the host takes one of 4 (1 ms against 1.04)


def test_route_ahead_takes_the_link_while_it_keeps_up_with_the_host():
    """CostModel.ahead_layer: a layer takes max(host seconds for the misses not prefetched, m
    fetches beyond the gap); the best m. CpuPlacement.split_plan: route-ahead (a plan fetching
    nothing, m prefetches) where it finishes a layer sooner than the in-layer plan; the plan alone
    without route-ahead, without a host rate, or where the link is slow and precision poor."""
    from types import SimpleNamespace

    from pdflash.offload.cost import CostModel
    from pdflash.offload.cpu_compute import CpuPlacement
    from pdflash.offload.stats import FetchStats

    cost = CostModel(13_000_000, link_gbps=52.0)  # 0.25 ms an expert over the link
    cost.observe_scheduler = lambda stats: None
    host_s = [2.5e-4]
    cost.set_cpu_expert_rate(lambda tokens: host_s[0])
    # 3 misses a layer, 0.7 of the prefetches needed, 0.25 ms between nodes: m = 2 leaves 1.6
    # on the host (0.4 ms) and the link's 0.5 ms - 0.25 fits; m = 3 leaves 0.9 (0.225 ms), but 0.75 - 0.25 ms
    m, s = cost.ahead_layer(3.0, 0.7, 1, 2.5e-4, 4)
    assert m == 2 and s == pytest.approx(1.6 * 2.5e-4)
    assert cost.ahead_layer(3.0, 0.7, 1, 2.5e-4, 1) == (1, pytest.approx(2.3 * 2.5e-4))
    assert cost.ahead_layer(3.0, 0.0, 1, 2.5e-4, 4)[0] == 0  # predictions never needed: none
    cost.set_cpu_expert_rate(None)
    assert cost.ahead_layer(3.0, 0.7, 1, 2.5e-4, 4) == (0, None)
    cost.set_cpu_expert_rate(lambda tokens: host_s[0])

    stats = FetchStats(num_layers=24)
    cache = SimpleNamespace(stats=stats, capacity=24 * 32 // 4)  # a quarter of the experts
    placer = CpuPlacement(cache, SimpleNamespace(stats=lambda: {}), SimpleNamespace(seconds_for=lambda t: host_s[0]), cost)
    plan, m = placer.split_plan(1, 4, 8, 32, None, True)
    assert m == 2 and plan == [0] * 5  # 3 misses (3/4 of 4 experts): the link on route-ahead only
    assert placer.split_plan(1, 4, 8, 32, None, False) == (placer.fetch_plan(1, 4, 8), 0)
    stats.route_ahead_sent, stats.route_ahead_used = 100, 5  # measured: 5 % of them needed
    cost.observe_link(0, 0.0)
    cost.observe_link(13e6, 1.0)  # and a link measured at 1 s an expert
    plan, m = placer.split_plan(1, 4, 8, 32, None, True)
    assert m == 0 and plan == placer.fetch_plan(1, 4, 8)


def test_route_ahead_window_is_the_gap_between_split_steps_host_nodes():
    """HostSteps.gap_seconds: the mean time between two host nodes of the split steps so far
    (their gaps hold the stages' call), before any the mean over every host step, None at first."""
    from types import SimpleNamespace

    from pdflash.offload.host_graph import HostSteps
    from pdflash.offload.stats import FetchStats

    fs = FetchStats(num_layers=5)
    steps = SimpleNamespace(num_layers=5, rt=SimpleNamespace(cache=SimpleNamespace(stats=fs)))
    assert HostSteps.gap_seconds(steps) is None
    fs.add_host_step("host", {"gaps": 0.004})
    assert HostSteps.gap_seconds(steps) == pytest.approx(0.001)  # 4 gaps a step
    fs.add_host_step("split", {"gaps": 0.008})
    fs.add_host_step("split", {"gaps": 0.012})
    assert HostSteps.gap_seconds(steps) == pytest.approx(0.0025)  # the split steps' alone


def test_kept_is_none_until_the_first_check_keeps_an_arm_then_counts_checks():
    clock = Clock()
    g = HybridGuard(window=2, rounds=1, hold=4, max_hold=16, recheck=1.0, arms=("off", "model"), clock=clock)
    seen = []
    for _ in range(1 + 4 + 4 + 4 + 2):
        seen.append(g.kept)
        g.on_forward(1)
        clock.t += 0.04 if g.arm == "off" else 0.05
    # the first check's 1 + 4 forwards, the hold's 4, the re-check's 4 (its arms take turns: still 1)
    assert seen[:5] == [None] * 5 and seen[5:13] == [1] * 8 and seen[13:] == [2, 2]  # it kept "off" again
    pinned = HybridGuard(arms=("off", "model"))
    pinned.pin("model")
    assert pinned.kept == 0


def test_a_switch_step_far_behind_ends_its_window_at_once():
    """An arm whose uncounted first step alone is ``switch_abandon`` x (1 + abandon) behind the best
    median leaves after that one step (the embedded pair's fetch-only arm on a GPU host: a 14 ms
    switch against 1.4 ms host steps); a switch merely slower than the next steps stays."""
    clock = Clock()
    g = HybridGuard(window=4, rounds=1, hold=64, settle=0, arms=("host", "model", "off"), clock=clock, trace=16)
    cost = {"host": [0.0014] * 4, "model": [0.0030, 0.0016, 0.0016, 0.0016], "off": [0.014, 0.005]}
    g.on_forward(1)
    seen = []
    for _ in range(4 + 4 + 1):
        arm = g.arm
        seen.append(arm)
        clock.t += cost[arm][sum(1 for a in seen if a == arm) - 1]
        g.on_forward(1)
    assert seen == ["host"] * 4 + ["model"] * 4 + ["off"]
    assert g.abandoned == 1 and g.checks == 1 and g.arm == "host"
    assert g.stats()["off_ms"] == pytest.approx(14.0)
    trace = g.stats()["trace"][:9]  # the check's steps, then the hold's
    assert [(t["arm"], t["counted"]) for t in trace] == (
        [("host", "switch")] + [("host", "counted")] * 3 + [("model", "switch")] + [("model", "counted")] * 3
        + [("off", "switch")])


def test_without_switch_abandon_a_slow_switch_step_is_not_judged():
    clock = Clock()
    g = HybridGuard(window=4, rounds=1, hold=64, settle=0, arms=("host", "off"), clock=clock, switch_abandon=None)
    cost = {"host": [0.0014] * 4, "off": [0.014, 0.005]}
    g.on_forward(1)
    seen = []
    for _ in range(4 + 2):
        arm = g.arm
        seen.append(arm)
        clock.t += cost[arm][min(sum(1 for a in seen if a == arm), 2) - 1]
        g.on_forward(1)
    assert seen == ["host"] * 4 + ["off"] * 2 and g.abandoned == 1  # the counted step leaves, as before
