"""The block planner (--block-size auto): its choices follow measured acceptance and costs,
with margins against noise, a realized floor, and probes."""

import copy
from types import SimpleNamespace

import pytest

from pdflash.draft.planner import AcceptanceModel, BlockPlanner, Choice, distinct_experts, expected_committed
from pdflash.draft.replay import link_bound_run, route_block
from pdflash.offload.cost import CostModel, Ewma, RecentMedian

L, E, K = 4, 32, 4
EXPERT_BYTES = 1_000_000


class FakeCache:
    capacity = 32

    def __init__(self):
        self.resident = set()

    def held(self):
        return set(self.resident), set()


def planner(link_gbps, max_block=8, **kw):
    cost = CostModel(EXPERT_BYTES, link_gbps=link_gbps)
    return BlockPlanner(max_block, cost, num_layers=L, num_experts=E, top_k=K, cache=FakeCache(), **kw)


def teach(p, accept_rate, steps=40, blocks=None):
    """Feed measured forwards: times flat in B (GPU-like), fetched experts growing with the union
    of the block's experts, and acceptance at ``accept_rate`` per position."""
    for i in range(steps):
        for block in blocks or range(1, p.max_block + 1):
            fetched = L * distinct_experts(block, E, K)
            p.cost.observe_forward("verify", block, 0.005 + fetched * p.cost.seconds_per_expert_fetch(), fetched)
            if block == 1:  # plain decoding's steady steps
                p._plain_steady.add(0.005 + fetched * p.cost.seconds_per_expert_fetch())
            else:
                p.cost.observe_forward("draft", block, 0.001)
                accepted = 0
                while accepted < block - 1 and (i * 7 + accepted * 3) % 100 < accept_rate * 100:
                    accepted += 1
                p.acceptance.record(block - 1, accepted)
            p._extra.setdefault(block, Ewma()).add(fetched)


def step(p, limit=8, seconds=None, accepted=None, repeating=False):
    """One step through the planner: the block it chose; ``accepted`` proposals of it (default all)."""
    p.begin_step()
    b = p.plan_draft(limit, repeating)
    if b > 1:
        p.after_draft(b, 0.001)
    acc = b - 1 if accepted is None else min(accepted, b - 1)
    t = seconds(b) if callable(seconds) else (seconds if seconds is not None else 0.01)
    p.end_step(b, acc, acc + 1, t, draft_seconds=0.001 if b > 1 else 0.0)
    return b


def test_expected_committed_and_distinct_experts():
    assert expected_committed([0.5, 0.5, 0.5], 1) == 1.0
    assert expected_committed([0.5, 0.5, 0.5], 4) == pytest.approx(1.875)
    assert distinct_experts(1, 32, 4) == pytest.approx(4.0)
    assert [round(distinct_experts(b, 32, 4), 1) for b in (2, 4)] == [7.5, 13.2]  # the figures
    assert distinct_experts(8, 32, 4) == pytest.approx(20.9, abs=0.2)


def test_acceptance_model_conditional_and_decay():
    m = AcceptanceModel(3, prior_mean=0.5, prior_weight=2)
    assert m.conditional() == [0.5, 0.5, 0.5]
    for _ in range(18):
        m.record(3, 3)
    for _ in range(18):
        m.record(3, 0)
    cond = m.conditional()
    assert cond[0] == pytest.approx((18 + 1) / (36 + 2))
    assert cond[1] > 0.9  # reached only when position 1 was accepted, and always accepted then
    d = AcceptanceModel(1, prior_mean=0.5, prior_weight=1, decay=0.5)
    for ok in (1, 1, 1, 1, 0, 0):  # recent refusals outweigh older acceptances
        d.record(1, ok)
    assert d.conditional()[0] < 0.5
    with pytest.raises(ValueError, match="decay"):
        AcceptanceModel(2, decay=0.0)


def test_cold_start_measures_plain_then_runs_the_home_block():
    p = planner(link_gbps=2)
    assert p.home_block == 4
    assert [step(p, seconds=0.03), step(p, seconds=0.01)] == [1, 1]  # the second prices steady plain decoding
    assert p._plain_steady.value == pytest.approx(0.01)
    assert step(p, accepted=1) == 4  # then half the draft's trained block
    assert p.cost.measured_forward("draft") == {4: pytest.approx(0.001)}
    rep = p.to_dict()
    assert rep["block_histogram"] == {"1": 2, "4": 1} and rep["home_block"] == 4


def test_slow_link_and_low_acceptance_choose_plain_decoding():
    p = planner(link_gbps=0.1)  # 10 ms per expert: every extra expert of a block costs a plain step
    teach(p, accept_rate=0.2)
    assert step(p) == 1


def test_cheap_link_and_high_acceptance_choose_long_blocks():
    p = planner(link_gbps=1000)
    teach(p, accept_rate=0.95)
    assert step(p) == 8


def test_noise_level_differences_keep_the_incumbent():
    """A block length predicted a few percent faster than the one running does not move the
    planner; one ahead by more than spec_margin (between two speculative lengths) does."""
    p = planner(link_gbps=20, acceptance=AcceptanceModel(7, prior_mean=0.6, prior_weight=4.0, decay=0.9),  # fixed prior mean
                spec_margin=1.15)
    teach(p, accept_rate=0.6)
    for _ in range(2):
        step(p, seconds=p._plain_steady.value)
    rates = {c.block: p._rate(c) for c in p._candidates(1, 8)}
    best = max(rates, key=rates.get)
    close = [b for b in range(2, 9) if b != best and rates[b] * p.spec_margin >= rates[best]]
    far = [b for b in range(2, 9) if rates[b] * p.spec_margin < rates[best]]
    assert close and far, rates
    p._incumbent = close[0]
    assert step(p, seconds=0.005) == close[0]
    p._incumbent = far[0]
    assert step(p, seconds=0.005) == best


@pytest.mark.parametrize("incumbent, moves", [(2, True), (1, False)])
def test_a_speculative_length_gives_way_at_the_small_margin_plain_decoding_at_the_large(incumbent, moves):
    """Blocks of 4 predicted 10 % ahead: a running block of 2 gives way to them (spec_margin 5 %);
    running plain decoding does not (switch_margin 15 %)."""
    p = planner(link_gbps=20, spec_margin=1.05)
    p._incumbent = incumbent
    rates = {1: 100.0, 2: 100.0, 4: 110.0}
    p._candidates = lambda low, limit: [SimpleNamespace(block=b, rate=rates.get(b, 50.0)) for b in range(low, limit + 1)]
    p._rate = lambda c: c.rate
    assert p._decide(8).block == (4 if moves else incumbent)


@pytest.mark.parametrize("trial_seconds, kept", [(0.030, True), (0.080, False)])
def test_a_length_priced_a_little_ahead_is_tried_and_stays_only_if_it_realizes_more(trial_seconds, kept):
    """Blocks of 4 priced 10 % ahead of running blocks of 2: inside the 15 % margin, past the 5 %
    trial margin. After 4 blocks of 2 (100 tokens per second realized) 4 blocks of 4 run as a trial:
    at 133 tokens per second they stay; at 50 the blocks of 2 come back, and blocks of 4 are not
    tried again for trial_cooldown steps."""
    p = planner(link_gbps=20, trial_blocks=4, trial_cooldown=10, floor=0.0, remeasure_plain_every=100)
    teach(p, accept_rate=0.9)
    rates = {1: 50.0, 2: 100.0, 4: 110.0}
    p._candidates = lambda low, limit: [Choice(b, rates.get(b, 10.0) * 0.01, 0.01, 0.0, 0.0) for b in range(low, limit + 1)]
    p._set_incumbent(2)
    chosen = [step(p, seconds=lambda b: trial_seconds if b == 4 else 0.02 * b / 2) for _ in range(20)]
    assert chosen[:8] == [2] * 4 + [4] * 4 and p.report.trials >= 1
    if kept:
        assert chosen[8:] == [4] * 12 and p.report.trials == p.report.trials_kept == 1, chosen
    else:  # back to 2; 4 again once the cooldown has passed and 4 blocks of 2 ran since
        assert chosen[8:18] == [2] * 10 and chosen[18:] == [4] * 2, chosen
        assert p.report.trials == 2 and p.report.trials_kept == 0
    assert p.to_dict()["trials"] == p.report.trials


def test_a_speculative_run_that_realizes_less_than_the_floor_goes_plain_and_probes():
    """The model predicts long blocks (fast link, high acceptance taught); the drafted steps
    realize a fraction of plain decoding's rate: after floor_window of them, plain decoding
    takes over until probes find the draft right again."""
    p = planner(link_gbps=1000, floor_window=4, probe_every=3, remeasure_plain_every=100)
    teach(p, accept_rate=0.95)
    plain = p._plain_steady.value
    blocks = [step(p, accepted=0, seconds=lambda b: 0.05 if b > 1 else plain) for _ in range(10)]
    # 4 drafted steps at a tenth of plain's rate, then plain; a probe after 3 plain steps, which
    # (accepting nothing, slow) does not pay: plain stays; the next probe waits twice as long
    assert blocks[:4] == [8, 8, 8, 8] and blocks[4:6] == [1, 1], blocks
    assert blocks[6] > 1 and blocks[7:] == [1, 1, 1], blocks
    assert p.report.probes == 1 and p._probe_interval == 6


@pytest.mark.parametrize("every,seconds,retreat,kept", [(0, 0.0105, 2.0, False), (0, 0.0105, None, True),
                                                          (2, 0.012, 2.0, True), (4, 0.012, 2.0, True)])
def test_a_speculative_incumbent_that_measurably_loses_retreats_to_plain_decoding(every, seconds, retreat, kept):
    """Plain decoding predicted 11-17 % ahead of a running block of 2, inside the 30 % margin that
    keeps a running length (plain 8.2 ms per token). Blocks of 10.5 ms that accept nothing realize
    0.78x, above the floor (0.7), with no spread: below plain decoding with confidence, so after
    floor_window of them plain decoding takes over (without retreat the margin keeps the block).
    Blocks of 12 ms accepting one proposal in 2 (1.02x) stay; one in 4 (0.85x) stays too, the
    spread of 8 blocks leaving 1x within two standard errors."""
    # the scenario's predictions are set with a fixed prior mean (0.6), so the retreat alone decides
    fixed = AcceptanceModel(3, prior_mean=0.6, prior_weight=4.0, decay=0.9)
    p = planner(link_gbps=5, max_block=4, floor_window=8, probe_every=1000, remeasure_plain_every=100, retreat=retreat,
                acceptance=fixed)
    teach(p, accept_rate=0.3)
    plain = p._plain_steady.value
    assert 1.0 < p._rate(p._candidate(1)) / p._rate(p._candidate(2)) < p.plain_margin
    p._set_incumbent(2)
    chosen = [step(p, limit=4, accepted=int(every > 0 and i % every == 0), seconds=lambda b: seconds if b > 1 else plain)
              for i in range(14)]
    if kept:
        assert chosen == [2] * 14 and p.report.retreats == 0, chosen
    else:
        assert chosen == [2] * 8 + [1] * 6 and p.report.retreats == 1, chosen
        assert not p._hold_plain and p.to_dict()["retreats"] == 1
    d = p.to_dict()  # the plain price and the realized ratio the retreat and floor read
    assert d["plain_step_ms"] == pytest.approx(plain * 1e3) and d["realized_vs_plain"] == pytest.approx(p._realized_ratio())


@pytest.mark.parametrize("settle,short_look,resumes", [(3, 2, 3), (0, 2, 11), (0, -1, 17)])
def test_one_slow_first_block_does_not_price_its_length_for_the_rest_of_the_run(settle, short_look, resumes):
    """Plain steps of 10 ms, blocks of 4 that take 12 ms and are accepted: the first block of 4
    takes 40 ms (a hiccup). Priced at that one measurement, plain decoding leads, and shadow probes
    (which verify no block) never refresh the price: 61 plain steps of 62 (session 16); now the
    probes' acceptance outgrows the price after 14 plain steps, 8 when speculation left after one
    block brings the first probe forward (short_look). Capped at 1.5x what the other lengths
    measured until it has 3 measurements of its own, drafting goes on at once."""
    p = planner(link_gbps=1000, settle=settle, short_look=short_look)
    chosen, first = [], True
    for _ in range(40):
        p.begin_step()
        b = p.plan_draft(8, can_shadow=True)
        if p.shadow_block:
            p.after_draft(p.shadow_block, 0.001)
            p.shadow_proposals([7] * (p.shadow_block - 1))
        if b > 1:
            p.after_draft(b, 0.001)
            p.end_step(b, b - 1, b, 0.001 + (0.040 if first else 0.012), draft_seconds=0.001, tokens=[7] * b)
            first = False
        else:
            p.end_step(1, 0, 1, 0.010, draft_seconds=0.001 if p.shadow_block else 0.0, tokens=[7])
        chosen.append(b)
    assert chosen[:3] == [1, 1, 4], chosen
    assert all(b == 1 for b in chosen[3:resumes]) and all(b > 1 for b in chosen[resumes:]), chosen


def test_probes_bring_speculation_back_when_the_draft_is_right_again():
    p = planner(link_gbps=1000, floor_window=2, probe_every=2, remeasure_plain_every=100)
    teach(p, accept_rate=0.95)
    plain = p._plain_steady.value
    for _ in range(2):
        step(p, accepted=0, seconds=lambda b: 0.05 if b > 1 else plain)
    assert step(p, seconds=plain) == 1
    assert step(p, seconds=0.01) > 1  # the probe: everything accepted
    assert step(p, seconds=0.01) > 1  # speculation is predicted well ahead again: it stays


def test_a_plain_step_is_remeasured_among_long_speculative_runs():
    p = planner(link_gbps=1000, remeasure_plain_every=5, remeasure_unless=None)
    teach(p, accept_rate=0.95)
    steady = p._plain_steady.count
    chosen = [step(p, seconds=lambda b: 0.005 if b == 1 else 0.006) for _ in range(12)]
    assert chosen == [8, 8, 8, 8, 1, 1, 8, 8, 8, 8, 1, 1]  # two plain steps: the second is the steady one
    assert p._plain_steady.count == steady + 2


def test_the_remeasurement_is_skipped_only_while_drafting_is_far_ahead():
    """Blocks of 8 committing 8 tokens in 6 ms against plain's 1 in 5 ms (6.7x): no plain steps.
    The same blocks committing 2 tokens in 8 ms (1.25x: plain 15 % faster would come within the
    margin): the two plain steps come as before."""
    p = planner(link_gbps=1000, remeasure_plain_every=5)
    teach(p, accept_rate=0.95)
    assert [step(p, seconds=lambda b: 0.005 if b == 1 else 0.006) for _ in range(12)] == [8] * 12
    assert p._realized_ratio() == pytest.approx(8 / 0.006 * p._plain_steady.value)
    p = planner(link_gbps=1000, remeasure_plain_every=5)
    teach(p, accept_rate=0.95)
    chosen = [step(p, accepted=1, seconds=lambda b: 0.005 if b == 1 else 0.008) for _ in range(6)]
    assert p._realized_ratio() is not None and 1.0 < p._realized_ratio() < 1.5
    assert chosen[:6] == [8, 8, 8, 8, 1, 1] and p.report.probes == 1, chosen


def test_plain_decoding_is_priced_by_its_steady_steps_not_the_first_after_speculation():
    """The first plain step after wide verify blocks refetches what they evicted; the planner
    prices B = 1 by plain steps that followed a plain step."""
    p = planner(link_gbps=1000, remeasure_plain_every=5)
    teach(p, accept_rate=0.5)
    p._plain_steady = RecentMedian()
    for b, seconds in ((8, 0.05), (1, 0.04), (1, 0.01), (1, 0.012)):  # transition 40 ms, steady 10-12 ms
        p.begin_step()
        p._drafting = b > 1
        p.end_step(b, 0, 1, seconds, draft_seconds=0.001 if b > 1 else 0.0)
    assert p._plain_steady.value == pytest.approx(0.011)
    assert p._candidate(1).predicted_seconds == pytest.approx(0.011)


def test_route_ahead_set_counts_missing_experts_of_the_latest_steps():
    p = planner(link_gbps=1)
    p._extra[1] = Ewma()
    p._extra[1].add(0.0)
    p._extra[2] = Ewma()
    p._extra[2].add(0.0)
    for experts in ([1, 2], [2, 3]):  # two plain steps, one committed token each
        p.begin_step()
        p.on_routed(0, experts)
        p.on_routed(1, experts)
        p.end_step(1, 0, 1, 0.01)
    p.cache.resident = {(0, 2), (1, 2), (1, 3)}
    assert p.fetch_experts(1) == (1.0, 1.0)  # latest step: (0,3) missing
    assert p.fetch_experts(2) == (3.0, 3.0)  # both steps: (0,1), (0,3), (1,1) missing
    # B = 8 unmeasured: no more history (route: the same set), its fetch B = 2's whole prediction
    # scaled by the random unions of 8 and 2 tokens
    assert p.fetch_experts(8) == (3.0, pytest.approx(3.0 * distinct_experts(8, E, K) / distinct_experts(2, E, K)))


def test_a_shorter_block_takes_its_share_of_a_longer_steps_route():
    """The latest step verified a block of 4 (its experts: the union of 4 tokens' routes, 8 of them
    missing now) and committed 3 tokens. A block of 1, 2 or 3 needs the experts of that many
    tokens, not all 4: u(B) / u(4) of them; a block of 4 reaches the step before, whole (one more
    missing expert)."""
    p = planner(link_gbps=1)
    for block, committed, experts in ((1, 1, [20]), (4, 3, list(range(8)))):
        p.begin_step()
        p.on_routed(0, experts)
        p.end_step(block, committed - 1, committed, 0.01)
    share = [distinct_experts(b, E, K) / distinct_experts(4, E, K) for b in (1, 2, 3)]
    assert p._route_missing(4) == pytest.approx([8 * share[0], 8 * share[1], 8 * share[2], 9.0])


def test_an_unmeasured_length_scales_the_nearest_measured_prediction_not_its_correction():
    """A block of 2 whose last step's experts are still resident predicts none of its route
    missing and learns a correction of its whole fetch (here 10 experts). A block of 4, never
    measured, whose route reaches 3 more experts that were evicted since, is predicted at the block
    of 2's whole fetch times the ratio of random unions: not 3 + 10 x that ratio, which counted
    the evicted ones twice."""
    p = planner(link_gbps=1)
    p._extra[2] = Ewma()
    p._extra[2].add(10.0)
    for experts in ([1, 2], [3, 4], [5, 6]):  # one committed token each
        p.begin_step()
        p.on_routed(0, experts)
        p.end_step(1, 0, 1, 0.01)
    p.cache.resident = {(0, 3), (0, 4), (0, 5), (0, 6)}  # the last two steps' experts
    ratio = distinct_experts(4, E, K) / distinct_experts(2, E, K)
    route2, fetch2 = p.fetch_experts(2)
    route4, fetch4 = p.fetch_experts(4)
    assert (route2, fetch2) == (0.0, 10.0) and route4 == 2.0
    assert fetch4 == pytest.approx(10.0 * ratio)


def test_a_stale_correction_is_priced_like_an_unmeasured_length():
    """A block of 4 learned its correction (10 experts) when the route of the last block of 4
    predicted few of its experts missing. After 8 steps of blocks of 2 (correction 6), the route of
    4 tokens reaches experts evicted since: route + the old correction would count them twice. The
    block of 4 is priced from the block of 2's whole prediction instead, as an unmeasured length."""
    def setup(fresh):
        p = planner(link_gbps=1, fresh_steps=fresh)
        for block, extra in [(4, 10.0)] + [(2, 6.0)] * 8:
            p.begin_step()
            p.on_routed(0, [block, block + 1])
            p.end_step(block, block - 1, block, 0.01)
            p._extra[block] = Ewma()
            p._extra[block].add(extra)
        return p

    ratio = distinct_experts(4, E, K) / distinct_experts(2, E, K)
    stale = setup(None)
    route2, fetch2 = stale.fetch_experts(2)
    route4, fetch4 = stale.fetch_experts(4)
    assert route2 == route4 == 2.0  # the history's experts, none resident
    assert fetch4 == 2.0 + 10.0  # the old correction on today's route
    fresh = setup(8)
    assert fresh.fetch_experts(2) == (2.0, 8.0)
    assert fresh.fetch_experts(4) == (2.0, pytest.approx(8.0 * ratio))
    assert fresh.to_dict().get("trace") is None


def test_the_trace_records_each_step_as_decided():
    p = planner(link_gbps=1, trace=True)
    teach(p, accept_rate=0.9)
    for _ in range(5):
        step(p)
    trace = p.to_dict()["trace"]
    assert len(trace) == 5
    for t in trace:
        assert t["measured_ms"] == pytest.approx(10.0)
        assert len(t["rates"]) == 8 and t["rates"][t["block"] - 1] is not None
        assert t["predicted_fetch"] is not None and t["missed"] == 0.0


def test_own_clock_replaces_the_callers_step_times():
    now = [0.0]
    p = planner(link_gbps=1000, clock=lambda: now[0])
    for _ in range(2):  # the cold start's plain steps
        p.begin_step()
        assert p.plan_draft(8) == 1
        now[0] += 0.004
        p.end_step(1, 0, 1, seconds=9.0)  # a wall time stretched by another process: ignored
    assert p.last_measured_seconds == pytest.approx(0.004)
    assert p.cost.measured_forward("verify") == {1: pytest.approx(0.004)}
    p.begin_step()
    assert p.plan_draft(8) == 4
    now[0] += 0.001
    p.after_draft(4, draft_seconds=5.0)
    now[0] += 0.006
    p.end_step(4, 3, 4, seconds=9.0, draft_seconds=5.0)
    assert p.cost.measured_forward("draft") == {4: pytest.approx(0.001)}
    assert p.cost.measured_forward("verify")[4] == pytest.approx(0.006)
    assert p.to_dict()["step_clock"] == "<lambda>"


def test_repeating_text_brings_the_probe_forward():
    p = planner(link_gbps=0.1, probe_every=16, min_repeat_gap=4)  # 10 ms per expert
    teach(p, accept_rate=0.2)
    for _ in range(8):
        p._plain_steady.add(0.01)  # plain steps measured at 10 ms: plain decoding is far ahead
    blocks = [step(p, accepted=0, repeating=i >= 2, seconds=lambda b: 0.01 if b == 1 else 0.05) for i in range(10)]
    # plain, then one early probe after 4 plain steps; it accepted nothing, so the next early
    # probe waits twice as long (8 plain steps: beyond these 10)
    assert [b > 1 for b in blocks] == [False, False, False, True, False, False, False, False, False, False], blocks
    assert p._repeat_gap == 8
    assert p._probe_interval == 16  # early probes leave the doubling interval alone
    for _ in range(4):  # the next one comes; its proposal is accepted: the gap is back to 4
        step(p, accepted=1, repeating=True, seconds=lambda b: 0.01 if b == 1 else 0.05)
    assert p._repeat_gap == 4


def test_a_drafted_step_is_never_a_plain_step():
    p = planner(link_gbps=1000)
    for _ in range(2):
        step(p, seconds=0.01)
    steady = list(p._plain_steady.samples)
    assert step(p, accepted=0, seconds=0.03) == 4
    assert p._plain_steady.samples == steady  # its draft time does not price plain decoding
    assert list(p._window) == [(1, 0.03)]


def test_repeat_index_sees_an_earlier_occurrence_only():
    from pdflash.draft.speculative import RepeatIndex

    t = [1, 2, 3, 4, 5]
    r = RepeatIndex(t)
    assert not r.repeating(t)  # (3, 4, 5) only ends here
    t += [1, 2, 3]
    assert r.repeating(t)
    t += [9]
    assert not r.repeating(t)
    t += [4, 5, 1, 2, 3]
    assert r.repeating(t)
    assert not RepeatIndex([7, 7]).repeating([7, 7])


@pytest.mark.parametrize("link_gbps, first, by_cost", [(0.2, 2, True), (1000, 4, True), (0.2, 4, False)],
                         ids=["link-bound", "compute-bound", "home-block-itself"])
def test_first_drafted_block_follows_what_extra_experts_cost(link_gbps, first, by_cost):
    """After the cold start's plain steps (each routing 4 random experts per layer, all fetched),
    the first drafted block is the shortest when every extra expert of a block costs link time
    (5 ms per expert here against 5 ms of compute), and half the trained block when fetches are
    nearly free."""
    import random

    rng = random.Random(0)
    moved = [0.0, 0.0]  # the scheduler's counters: bytes, link-busy seconds
    p = planner(link_gbps=link_gbps, link_counters=lambda: tuple(moved), first_by_cost=by_cost)
    for _ in range(2):
        p.begin_step()
        assert p.plan_draft(8) == 1
        for layer in range(L):
            p.on_routed(layer, rng.sample(range(E), K))
        fetched = L * K
        moved[0] += fetched * EXPERT_BYTES
        moved[1] += fetched * EXPERT_BYTES / (link_gbps * 1e9)
        p.end_step(1, 0, 1, 0.005 + fetched * p.cost.seconds_per_expert_fetch())
    assert p.home_block == 4 and p._plain_fetched.value == L * K
    assert step(p, accepted=1) == first


def shadow_step(p, committed, limit=8, seconds=0.01):
    """One greedy step through the planner with shadow probes allowed: the block it chose, and the
    shadow probe's length (0: none). A shadow probe's proposals are ``committed`` tokens' worth of
    what the caller later commits; ``committed`` is this step's committed tokens."""
    p.begin_step()
    b = p.plan_draft(limit, can_shadow=True)
    shadow = p.shadow_block
    if b > 1 or shadow:
        p.after_draft(max(b, shadow), 0.001)
    p.end_step(b, len(committed) - 1, len(committed), seconds, draft_seconds=0.001 if b > 1 or shadow else 0.0,
               tokens=committed)
    return b, shadow


def test_a_periodic_probe_becomes_a_shadow_probe_that_verifies_no_block():
    """Plain decoding leads; the probe drafts (at least home_block positions) but the step verifies
    one token. Its proposals are checked against the tokens committed next, over as many steps as
    they take, and the accepted prefix is recorded like a verified block's."""
    p = planner(link_gbps=0.1, probe_every=3)
    teach(p, accept_rate=0.2)
    p._incumbent = 1
    before = list(p.acceptance.reached), list(p.acceptance.accepted)
    expect = copy.deepcopy(p.acceptance)
    assert [shadow_step(p, [i]) for i in range(2)] == [(1, 0), (1, 0)]
    p.begin_step()
    assert p.plan_draft(8, can_shadow=True) == 1
    assert p.shadow_block == p.home_block == 4  # the best block is 2 here; one pass measures 3 positions
    assert p.report.probes == p.report.shadow_probes == 1 and p._plain_run == 0
    p.after_draft(4, 0.001)
    p.shadow_proposals([10, 11, 12])
    steady = p._plain_steady.count
    p.end_step(1, 0, 1, 0.01, draft_seconds=0.001, tokens=[10])
    assert p._plain_steady.count == steady  # a step that ran the draft does not price plain decoding
    assert (list(p.acceptance.reached), list(p.acceptance.accepted)) == before  # 10 matched, 11 and 12 open
    shadow_step(p, [11])
    shadow_step(p, [99])  # position 3 refused
    expect.record(3, 2)
    assert p.acceptance.conditional() == pytest.approx(expect.conditional())
    assert p._shadow == [] and p.report.histogram.get(4) is None  # no block of 4 was verified


def test_a_shadow_probe_resolves_when_every_proposal_matched():
    p = planner(link_gbps=0.1)
    p.shadow_proposals([5, 6])
    p.begin_step()
    p.end_step(2, 1, 2, 0.01, tokens=[5, 6, 7])  # a verified block committing past the proposals
    assert p._shadow == []
    # the block's record of position 1, decayed, then the shadow's of positions 1 and 2
    assert p.acceptance.reached[:2] == [pytest.approx(1.9), pytest.approx(1.0)]
    assert p.acceptance.accepted[:2] == [pytest.approx(1.9), pytest.approx(1.0)]


def test_without_shadow_permission_probes_verify_their_block():
    """Sampling (no comparison with committed tokens) and the floor's hold keep probes real."""
    p = planner(link_gbps=0.1, probe_every=3)
    teach(p, accept_rate=0.2)
    p._incumbent = 1
    assert [step(p, accepted=0, seconds=lambda b: 0.01 if b == 1 else 0.05) for _ in range(3)][-1] > 1
    q = planner(link_gbps=0.1, probe_every=3)
    teach(q, accept_rate=0.2)
    q._incumbent, q._hold_plain = 1, True
    assert [shadow_step(q, [i])[0] for i in range(3)][-1] > 1 and q.report.shadow_probes == 0


def test_cold_start_shadow_probes_where_the_first_block_is_not_predicted_to_pay():
    """Link-bound: the first block (2) is predicted below plain decoding's rate under the prior
    acceptance, so plain decoding stays and the first look is a shadow probe of home_block
    positions. Compute-bound: the first block is drafted and verified as before."""
    import random

    for link_gbps, expect in ((0.2, (1, 4)), (1000, (4, 0))):
        rng = random.Random(0)
        moved = [0.0, 0.0]
        p = planner(link_gbps=link_gbps, link_counters=lambda: tuple(moved))
        for _ in range(2):
            p.begin_step()
            assert p.plan_draft(8, can_shadow=True) == 1 and p.shadow_block == 0
            for layer in range(L):
                p.on_routed(layer, rng.sample(range(E), K))
            moved[0] += L * K * EXPERT_BYTES
            moved[1] += L * K * EXPERT_BYTES / (link_gbps * 1e9)
            p.end_step(1, 0, 1, 0.005 + L * K * p.cost.seconds_per_expert_fetch(), tokens=[1])
        assert shadow_step(p, [1]) == expect, link_gbps
        assert p.report.shadow_probes == (1 if expect[1] else 0)


@pytest.mark.parametrize("committed, drafts", [([10, 11, 12], True), ([99], False)], ids=["accepted", "refused"])
def test_after_the_first_shadow_look_the_cold_start_rule_decides_on_what_it_saw(committed, drafts):
    """A prior of 0.3 puts the first block (2) behind plain decoding at a 2 GB/s link: the first
    look is a shadow probe. Once its proposals are checked, the cold start's rule decides again on
    the measured acceptance: all three accepted put the block ahead and it is drafted (without the
    switch margin a move from plain decoding needs later); a refusal keeps plain decoding."""
    import random

    rng = random.Random(0)
    moved = [0.0, 0.0]
    p = planner(link_gbps=2, link_counters=lambda: tuple(moved),
                acceptance=AcceptanceModel(7, prior_mean=0.3, prior_weight=1.0, decay=0.9))

    def plain_step(tokens):
        p.begin_step()
        b = p.plan_draft(8, can_shadow=True)
        for layer in range(L):
            p.on_routed(layer, rng.sample(range(E), K))
        moved[0] += L * K * EXPERT_BYTES
        moved[1] += L * K * EXPERT_BYTES / 2e9
        if p.shadow_block:
            p.after_draft(p.shadow_block, 0.0001)
            p.shadow_proposals([10, 11, 12])
        p.end_step(b, 0, 1, 0.005 + L * K * p.cost.seconds_per_expert_fetch(), tokens=tokens,
                   draft_seconds=0.0001 if p.shadow_block else 0.0)
        return b, p.shadow_block

    assert [plain_step([1]), plain_step([2])] == [(1, 0), (1, 0)]
    assert plain_step(committed[:1]) == (1, 4)  # the first look
    for t in committed[1:]:
        assert plain_step([t]) == (1, 0)  # still being checked
    p.begin_step()
    assert (p.plan_draft(8, can_shadow=True) > 1) == drafts


def test_a_verified_block_drafts_past_itself_and_records_the_positions_its_tail_reached():
    """Overdraft: a block of 2 drafts twice as many positions where proposals can be checked (greedy). All of
    the block accepted: its two extra proposals are checked from the bonus token on, across the
    next step, and the block is recorded as 3 drafted positions with the prefix they matched."""
    p = planner(link_gbps=1000, max_block=8, home_block=2, first_by_cost=False)
    assert p.drafted_for(2, can_shadow=True) == 4 and p.drafted_for(3, can_shadow=True) == 6
    assert p.drafted_for(5, can_shadow=True) == 8
    assert p.drafted_for(2, can_shadow=False) == 2 and p.drafted_for(1, can_shadow=True) == 1
    for i in range(2):  # the cold start's plain steps
        shadow_step(p, [i])
    p.begin_step()
    assert p.plan_draft(8, can_shadow=True) == 2 and p.draft_block == 4
    p.after_draft(4, 0.001)
    before = list(p.acceptance.reached), list(p.acceptance.accepted)
    expect = copy.deepcopy(p.acceptance)
    # proposals 10, 11 | 12, 13: the block verifies 10 (accepted) and commits the bonus 11
    p.end_step(2, 1, 2, 0.01, draft_seconds=0.001, tokens=[10, 11], tail=[11, 12])
    assert (list(p.acceptance.reached), list(p.acceptance.accepted)) == before  # 11 matched, 12 open
    assert p.report.overdrafted == 1
    p.begin_step()
    p.plan_draft(8, can_shadow=True)
    p.end_step(1, 0, 1, 0.01, tokens=[99])  # position 3 refused
    expect.record(3, 2)
    assert p.acceptance.conditional() == pytest.approx(expect.conditional())
    assert p._tails == []


def test_a_refused_block_records_at_once_and_sampling_drafts_only_the_block():
    p = planner(link_gbps=1000, home_block=2, first_by_cost=False)
    for i in range(2):
        shadow_step(p, [i])
    p.begin_step()
    assert p.plan_draft(8, can_shadow=True) == 2 and p.draft_block == 4
    before = copy.deepcopy(p.acceptance)
    p.end_step(2, 0, 1, 0.01, draft_seconds=0.001, tokens=[7], tail=[8, 9])
    before.record(1, 0)
    assert p.acceptance.conditional() == pytest.approx(before.conditional()) and p._tails == []
    p.begin_step()
    assert p.plan_draft(8, can_shadow=False) == 2 and p.draft_block == 2  # nothing to check a tail against
    q = planner(link_gbps=1000, home_block=2, first_by_cost=False, overdraft=1)
    for i in range(2):
        shadow_step(q, [i])
    q.begin_step()
    assert q.plan_draft(8, can_shadow=True) == 2 and q.draft_block == 2
    with pytest.raises(ValueError, match="overdraft"):
        planner(link_gbps=1000, overdraft=0)


@pytest.mark.parametrize("overdraft, leaves_two", [(1, False), (2, True)])
def test_short_blocks_that_are_always_accepted_measure_longer_ones_only_by_overdrafting(overdraft, leaves_two):
    """The H100 run of session 16 at P = 0.9: blocks of 2 were taken first and kept for the whole
    run, positions past them never measured (prior 0.6), a block of 4 predicted under the switch
    margin. Here every proposal is right and a verify forward costs 10 ms + 4 ms per token (known
    for every length): with the tail checked, the planner measures positions 2 and 3 and moves to
    longer blocks."""
    p = planner(link_gbps=1000, home_block=2, first_by_cost=False, overdraft=overdraft, spec_margin=1.15,
                trial_margin=None)  # session 16's margin, no trials: overdraft alone
    for b in range(1, 9):
        p.cost.observe_forward("verify", b, 0.010 + 0.004 * b)
        p.cost.observe_forward("draft", b, 0.001)
    pos = 0  # the text is 0, 1, 2, ...; the last committed token is `pos`
    for _ in range(40):
        p.begin_step()
        b = p.plan_draft(8, can_shadow=True)
        drafted = max(b, p.draft_block)
        if drafted > 1:
            p.after_draft(drafted, 0.001)
        proposals = list(range(pos + 1, pos + drafted))
        new = proposals[: b - 1] + [pos + b]
        p.end_step(b, b - 1, b, 0.001 * (drafted > 1) + 0.010 + 0.004 * b,
                   draft_seconds=0.001 if drafted > 1 else 0.0, tokens=new, tail=proposals[b - 1:])
        pos += b
    hist = p.report.histogram
    assert hist.get(2, 0) > 0
    assert (max(hist) > 2) == leaves_two, hist


@pytest.mark.parametrize("probe_tokens, interval", [([10, 11, 12], 2), ([10, 99], 12)], ids=["all-accepted", "refused"])
def test_a_fully_accepted_shadow_probe_brings_the_probe_interval_back(probe_tokens, interval):
    """Plain decoding leads and the probe interval has doubled; a shadow probe whose proposals are
    all accepted sets it to probe_after_accept (2: look again soon), one with a refusal leaves it doubled."""
    p = planner(link_gbps=0.1, probe_every=3)
    teach(p, accept_rate=0.2)
    p._incumbent, p._probe_interval = 1, 6
    for i in range(5):
        shadow_step(p, [i])
    p.begin_step()
    assert p.plan_draft(8, can_shadow=True) == 1 and p.shadow_block == 4 and p._probe_interval == 12
    p.after_draft(4, 0.001)
    p.shadow_proposals([10, 11, 12])
    p.end_step(1, 0, 1, 0.01, draft_seconds=0.001, tokens=probe_tokens[:1])
    for t in probe_tokens[1:]:
        shadow_step(p, [t])
    assert p._shadow == [] and p._probe_interval == interval


def test_misses_the_host_computes_count_as_the_misses_fetched_do():
    """Hybrid execution: a planner whose misses are computed on the host (the "host" placement,
    counted by ``host_counter``, no link bytes) at the price one fetch costs the other planner
    makes the same choices, and records its forwards without that host time."""
    import random

    price = 0.0005  # seconds per missing expert, on either pipe; a step's own work 40 ms

    def run(host: bool):
        rng = random.Random(1)
        moved = [0.0, 0.0]
        computed = [0]
        cost = CostModel(EXPERT_BYTES, link_gbps=EXPERT_BYTES / price / 1e9)
        if host:
            cost.set_cpu_expert_rate(lambda tokens: price, placement=lambda tokens: "host")
        p = BlockPlanner(8, cost, num_layers=L, num_experts=E, top_k=K, cache=FakeCache(),
                         link_counters=lambda: tuple(moved), host_counter=(lambda: computed[0]) if host else None)
        pos = 0
        for _ in range(60):
            p.begin_step()
            b = p.plan_draft(8, can_shadow=True)
            drafted = max(b, p.draft_block, p.shadow_block)
            if drafted > 1:
                p.after_draft(drafted, 0.001)
            misses = route_block(p, rng, b)
            if host:
                computed[0] += misses
            else:
                moved[0] += misses * EXPERT_BYTES
                moved[1] += misses * price
            new = list(range(pos + 1, pos + b + 1))  # every proposal right
            p.end_step(b, b - 1, b, 0.001 * (drafted > 1) + 0.040 + misses * price,
                       draft_seconds=0.001 if drafted > 1 else 0.0, tokens=new,
                       tail=list(range(pos + b, pos + drafted)) if drafted > b else ())
            pos += b
        return p

    link, host = run(False), run(True)
    assert host.report.histogram == link.report.histogram and max(host.report.histogram) > 1
    assert host.report.host_experts > 0 and host.report.fetched_experts == 0
    assert host.cost.forward_seconds("verify", 1) == pytest.approx(link.cost.forward_seconds("verify", 1))
    assert host.cost.forward_seconds("verify", 1) == pytest.approx(0.040)  # the misses' time is off


def _link_bound_run(acceptance_model, p_accept=0.9, steps=80, seed=3, **planner_kw):
    """The planner after ``steps`` steps of the replayed H100 regime (pdflash.draft.replay)."""
    if acceptance_model is not None:
        planner_kw["acceptance"] = acceptance_model
    return link_bound_run(p_accept, seed, steps=steps, **planner_kw).planner


def test_a_link_bound_target_at_high_acceptance_runs_long_blocks():
    """On the H100 at P = 0.9 blocks of 4 and 8 ran 1.50x and 1.60x plain decoding while the planner
    kept blocks of 1 and 2 (1.07x, then 1.23x). In this replay of that regime (8 seeds) most steps
    run blocks of 4 or more, more of them than with acceptance shrunk toward a fixed prior mean.
    Before unmeasured lengths were priced from the nearest measured one's whole fetch
    (``BlockPlanner._fetch``) the same replay ran blocks of 4 or more in 35 % of steps on average,
    blocks of 2 for 58 and 64 of 80 steps on two seeds, as on the H100."""
    def long_share(model_for):
        shares = []
        for seed in range(8):
            h = _link_bound_run(model_for(), seed=seed).report.histogram
            shares.append(sum(c for b, c in h.items() if b >= 4) / sum(h.values()))
        return sum(shares) / len(shares)

    p = _link_bound_run(None)
    cands = p.to_dict()["candidates"]  # the report prices every length as the decision does
    assert set(cands) == {str(b) for b in range(1, 9)}
    for c in p._candidates(1, 8):
        assert cands[str(c.block)]["tokens_per_second"] == pytest.approx(p._rate(c))
        assert cands[str(c.block)]["expected_tokens"] == pytest.approx(c.expected_tokens)
    fixed = long_share(lambda: AcceptanceModel(7, prior_mean=0.6, prior_weight=4.0, decay=0.9))
    longrun = long_share(lambda: None)  # the planner's own model
    assert longrun > 0.7 and longrun > fixed + 0.05, (longrun, fixed)


def test_speculation_left_after_a_short_look_is_probed_again_soon():
    """The replayed H100 regime at P = 0.9 on the seeds whose first block of 2 is refused (its one
    proposal wrong): plain decoding leads on that single observation. Left after at most
    ``short_look`` verified blocks, the first shadow probe comes after 2 plain steps instead of 8
    (on an H100 such a prompt ran 16 plain steps of 30, session 22), and drafting resumes sooner."""
    refused = [seed for seed in range(48) if link_bound_run(0.9, seed, steps=3).steps[2][:2] == (2, 0)]
    assert len(refused) >= 3, refused
    for seed in refused:
        soon = link_bound_run(0.9, seed, horizon=48).steps
        late = link_bound_run(0.9, seed, horizon=48, short_look=-1).steps
        assert soon[:4] == late[:4] and soon[3][0] == 1  # the same start: refused, then plain
        assert soon[4][2] and not any(shadow for _, _, shadow in late[3:10]), (soon[:12], late[:12])
    def first_draft(steps):
        return next((i for i, (b, _, _) in enumerate(steps) if i > 2 and b > 1), len(steps))

    resumed = [(first_draft(link_bound_run(0.9, s, horizon=48).steps),
                first_draft(link_bound_run(0.9, s, horizon=48, short_look=-1).steps)) for s in refused]
    assert sum(a < b for a, b in resumed) > len(resumed) / 2 and sum(a for a, _ in resumed) < sum(b for _, b in resumed), resumed


def test_acceptance_is_shrunk_toward_the_runs_long_run_acceptance():
    """Blocks of 4 accepted at 0.9 per position. Shrunk toward a fixed prior mean 0.6 with weight 4
    next to counts decayed by 0.9 (at most 10 blocks' worth), position 1's estimate averages about
    0.81, and a block of 4 is then predicted to commit 3.1 tokens for 3.44 (the planner on an H100,
    session 19, estimated 0.88 / 0.71 / 0.75 at P = 0.9 and kept blocks of 2). Shrunk toward the run's
    long-run acceptance (counts decayed by 0.98) it is within sampling of 0.9."""
    import random

    rng = random.Random(0)
    fixed = AcceptanceModel(7, prior_mean=0.6, prior_weight=4.0, decay=0.9)
    longrun = AcceptanceModel(7, prior_mean=0.6, prior_weight=4.0, decay=0.9, slow_decay=0.98)
    sums = {"fixed": 0.0, "longrun": 0.0}
    for i in range(300):
        n = 0
        while n < 3 and rng.random() < 0.9:
            n += 1
        for name, model in (("fixed", fixed), ("longrun", longrun)):
            model.record(3, n)
            if i >= 50:
                sums[name] += model.conditional()[0] / 250
    assert sums["fixed"] < 0.83 and 0.87 < sums["longrun"] < 0.93, sums
    assert longrun.conditional()[3:] == pytest.approx([0.6] * 4)  # never reached: the prior mean
    with pytest.raises(ValueError, match="slow_decay"):
        AcceptanceModel(2, slow_decay=0.0)


@pytest.mark.parametrize("route_right", [True, False], ids=["route-right", "route-wrong"])
def test_the_fetch_prediction_with_the_smaller_recent_error_prices_the_blocks(route_right):
    """Each step routes 1 or 3 experts per layer in turn. Where the next step fetches what the last
    one routed (route-ahead right) the route prediction is exact and the recent mean of what steps
    fetched (alternately 4 and 12) is off by 4: the route prices the blocks. Where every step
    fetches 8 whatever the routes (on the gpt-oss-20b-shaped checkpoint the route-ahead prediction
    erred 30-110 % more than that mean, session 21), the mean prices them."""
    moved = [0.0, 0.0]
    cost = CostModel(EXPERT_BYTES, link_gbps=1.0)
    p = BlockPlanner(8, cost, num_layers=L, num_experts=E, top_k=K, cache=FakeCache(),
                     link_counters=lambda: tuple(moved))
    last = 0
    for i in range(30):
        p.begin_step()
        assert p.plan_draft(1) == 1
        fetched = last if route_right else 8
        moved[0] += fetched * EXPERT_BYTES
        moved[1] += fetched * EXPERT_BYTES / 1e9
        width = 1 if i % 2 == 0 else 3
        for layer in range(L):
            p.on_routed(layer, range(width))
        last = width * L
        p.end_step(1, 0, 1, 0.01)
    assert p._use_mean() != route_right, (p._err_route.value, p._err_mean.value)
    report = p.to_dict()["fetch_prediction"]  # what --json shows
    assert report["in_use"] == ("route" if route_right else "mean") and report["mode"] == "best"
    assert report["route_error"] == p._err_route.value and report["mean_error"] == p._err_mean.value
    c = p._candidate(1)
    assert c.fetch_experts == (c.fetch_mean if not route_right else c.fetch_route)
    if route_right:
        assert c.fetch_route == pytest.approx(last, abs=0.5)  # this step fetches what the last routed
    else:
        assert c.fetch_mean == pytest.approx(8.0, abs=0.1)
    no_counters = planner(link_gbps=1.0)  # misses not measured: no recent mean, the route prices
    for _ in range(3):
        step(no_counters, limit=1)
    assert no_counters._candidate(1).fetch_mean is None and not no_counters._use_mean()


def test_the_fetch_prediction_can_be_pinned():
    """``fetch_prediction`` "route" / "mean" pins one prediction (benchmark arms); anything else is refused."""
    assert not planner(link_gbps=1.0, fetch_prediction="route")._use_mean()
    assert planner(link_gbps=1.0, fetch_prediction="mean")._use_mean()
    with pytest.raises(ValueError, match="fetch_prediction"):
        planner(link_gbps=1.0, fetch_prediction="guess")
    assert planner(link_gbps=1.0, long_run_weight=4.0).acceptance.slow_weight == 4.0



def test_parse_variant_reads_blockplanner_keyword_arguments():
    from pdflash.draft.planner import parse_variant

    assert parse_variant('home8={"first_by_cost": false, "home_block": 8}') == ("home8", {"first_by_cost": False, "home_block": 8})
    assert parse_variant("plain-ish={}") == ("plain-ish", {})
    for bad, why in (("home", "NAME=JSON"), ("=1", "NAME=JSON"), ("a={", "not JSON"), ("a=[1]", "JSON object"),
                     ('a={"fast": 1}', "fast"), ('a={"max_block": 4}', "max_block"), ('a={"self": 1}', "self")):
        with pytest.raises(ValueError, match=why):
            parse_variant(bad)


def _route_history(p, rng, steps=12):
    """Steps with routed experts (some resident), as the runtime's routing observer reports them."""
    import random
    r = random.Random(rng)
    for _ in range(steps):
        p.begin_step()
        b = p.plan_draft(8)
        for layer in range(L):
            p.on_routed(layer, sorted(r.sample(range(E), K * b if K * b <= E else E)))
        if r.random() < 0.5:
            p.cache.resident.add((r.randrange(L), r.randrange(E)))
        acc = r.randrange(b)
        p.end_step(b, acc, acc + 1, 0.01 + 0.002 * b, draft_seconds=0.001 if b > 1 else 0.0)


@pytest.mark.parametrize("link_gbps, accept_rate", [(0.1, 0.2), (1000, 0.95), (2, 0.6)])
def test_b1_alone_is_priced_as_among_every_length(link_gbps, accept_rate):
    """B = 1 priced alone (_candidate(1), its route the latest step's) is exactly the B = 1 of
    _candidates over every length."""
    p = planner(link_gbps=link_gbps)
    teach(p, accept_rate=accept_rate, steps=6)
    for seed in range(4):
        _route_history(p, seed)
        assert p._candidate(1) == p._candidates(1, 8)[0]


def test_plain_decoding_far_ahead_prices_every_length_every_few_steps():
    """Far ahead of every drafted length, plain steps price only B = 1 between rechecks; a block
    recorded in the acceptance (here a shadow probe's) prices every length at the next step."""
    def full_pricings(p, steps):
        seen = []
        real = p._candidates
        p._candidates = lambda low, limit: (seen.append(limit), real(low, limit))[1]
        for _ in range(steps):
            assert step(p) == 1
        del p._candidates
        return sum(1 for limit in seen if limit > 1)

    lazy = planner(link_gbps=0.1, shadow_probes=False, probe_every=10_000, max_probe_interval=10_000)
    teach(lazy, accept_rate=0.2)
    eager = copy.deepcopy(lazy)
    eager.recheck_below = None
    assert full_pricings(eager, 12) == 12
    assert full_pricings(lazy, 12) == 4  # the cold start (a drafted incumbent at first), then steps 2, 6, 10
    before = lazy.acceptance.records
    lazy._recheck_at = lazy._steps + 100
    lazy.begin_step()
    assert lazy.plan_draft(8, can_shadow=True) == 1
    lazy.shadow_proposals([10, 11, 12])  # as if a shadow probe ran: its first proposal is refused below
    lazy.end_step(1, 0, 1, 0.01, tokens=[99])
    assert lazy.acceptance.records == before + 1 and lazy._recheck_at == 0
    assert full_pricings(lazy, 1) == 1
    with pytest.raises(ValueError):
        planner(link_gbps=1, recheck_below=1.5)
    with pytest.raises(ValueError):
        planner(link_gbps=1, recheck_every=0)


def test_steps_are_plain_while_the_hybrid_placement_is_first_chosen():
    """The guard's first check tries its arms in turn: every step is plain (blocks would be priced
    against plain steps of other arms); once it keeps an arm, the run starts as a first one does."""
    kept = [None]
    p = planner(link_gbps=1000, placement=lambda: kept[0])
    teach(p, accept_rate=0.95)  # blocks of 8 would pay
    assert [step(p) for _ in range(5)] == [1] * 5
    assert p.report.placing_steps == 5 and p.report.placement_restarts == 0
    kept[0] = 1  # the check kept an arm: what was measured before is dropped
    chosen = [step(p, seconds=lambda b: 0.02 if b == 1 else 0.006) for _ in range(4)]
    assert chosen[:2] == [1, 1] and chosen[2] > 1, chosen  # plain until measured, then the cold start's block
    assert p.report.placement_restarts == 1 and p._plain_steady.count >= 1


def test_a_newly_kept_placement_drops_the_step_times_measured_under_the_last():
    """Plain steps measured slow under the last kept arm made blocks look ahead; under the new arm
    plain decoding is measured again before a length is chosen, and wins."""
    kept = [1]
    p = planner(link_gbps=1000, placement=lambda: kept[0], remeasure_plain_every=64)
    teach(p, accept_rate=0.3)
    for _ in range(8):
        p._plain_steady.add(0.05)  # plain steps of a slow arm
    assert [step(p, accepted=0, seconds=lambda b: 0.012 if b > 1 else 0.05) for _ in range(3)][-1] > 1
    assert p._incumbent > 1
    kept[0] = 2
    chosen = [step(p, accepted=0, seconds=lambda b: 0.012 if b > 1 else 0.005) for _ in range(2)]
    assert chosen == [1, 1] and p._plain_steady.value == pytest.approx(0.005) and p._incumbent is None
    assert p.report.placement_restarts == 1 and not p._window and not p._run
    assert p._candidate(1).predicted_seconds == pytest.approx(0.005)  # the new arm's plain steps price B = 1


def test_without_a_placement_callback_nothing_is_held_plain():
    p = planner(link_gbps=1000)
    teach(p, accept_rate=0.95)
    assert step(p) == 8 and p.report.placing_steps == 0


def test_plain_while_placing_off_plans_the_checks_steps_as_any_other():
    p = planner(link_gbps=1000, placement=lambda: None, plain_while_placing=False)
    teach(p, accept_rate=0.95)
    assert step(p) == 8 and p.report.placing_steps == 0


def test_the_planner_environment_variable_is_read_and_refused_when_wrong(monkeypatch):
    from pdflash import PdflashError
    from pdflash.draft.offloaded import planner_variant

    monkeypatch.delenv("PDFLASH_PLANNER", raising=False)
    assert planner_variant() == {}
    monkeypatch.setenv("PDFLASH_PLANNER", '{"plain_while_placing": false, "recheck_every": 2}')
    assert planner_variant() == {"plain_while_placing": False, "recheck_every": 2}
    for bad, says in (("{not json", "not JSON"), ('{"no_such": 1}', "no_such"), ("[1]", "JSON object")):
        monkeypatch.setenv("PDFLASH_PLANNER", bad)
        with pytest.raises(PdflashError, match=says):
            planner_variant()


def test_a_plain_step_decided_ahead_is_the_one_plan_draft_would_choose_without_pricing(monkeypatch):
    """Whenever ``decide_plain`` lets the loop run a step as plain decoding (filed with
    ``end_step``), ``begin_step`` and ``plan_draft`` on a copy of the planner taken before it
    choose a plain step too, with no shadow probe, no probe, no length but B = 1 priced, and leave
    the planner as decide_plain left it: the lean step changes no decision."""
    checked = []
    real = BlockPlanner.decide_plain

    def decide_plain(self, limit, repeating=False):
        twin = copy.deepcopy(self)
        decided = real(self, limit, repeating)
        if decided:
            twin._decide = lambda *a: pytest.fail("a step decided ahead priced every length")
            twin.begin_step()
            assert twin.plan_draft(limit, repeating, can_shadow=True) == 1
            assert (twin.shadow_block, twin.draft_block, twin._probe) == (0, 0, False)
            checked.append(self._steps)
        for name in ("_stage", "_plain_run", "_spec_run", "_forced_plain", "_incumbent", "_recheck_at",
                     "_probe_interval", "_trial", "_placing"):  # (False: decide_plain changed nothing)
            assert getattr(twin, name) == getattr(self, name), name
        assert twin.report.to_dict() == self.report.to_dict()
        return decided

    monkeypatch.setattr(BlockPlanner, "decide_plain", decide_plain)
    for p_accept, seed in [(0.3, 0), (0.3, 1), (0.7, 2), (0.9, 3)]:
        link_bound_run(p_accept, seed, horizon=96)
    assert len(checked) > 40  # at P = 0.3 most plain steps are decided ahead


def test_the_replay_decides_the_same_with_plain_steps_decided_ahead():
    """The replayed regime runs the same blocks, probes and times whether its plain steps go
    through decide_plain / end_step or begin_step / plan_draft / end_step."""
    for p_accept in (0.9, 0.7, 0.3):
        for seed in range(6):
            lean = link_bound_run(p_accept, seed, horizon=64)
            full = link_bound_run(p_accept, seed, horizon=64, decided_ahead=False)
            assert lean.steps == full.steps and lean.seconds == pytest.approx(full.seconds)
            assert lean.planner.report.to_dict() == full.planner.report.to_dict()


def test_a_plain_step_decided_ahead_is_filed_as_a_plain_step():
    """``end_step`` after ``decide_plain`` counts the step, its committed token, its time as steady
    plain decoding and its misses, as for a plain step plan_draft chose."""
    import random

    moved = [0.0, 0.0]
    p = planner(25.0, link_counters=lambda: tuple(moved))
    for _ in range(2):
        assert p.decide_plain(8)  # the cold start: plain until plain decoding is measured
        route_block(p, random.Random(0), 1)
        moved[0] += 3 * EXPERT_BYTES
        moved[1] += 0.001
        p.end_step(1, 0, 1, 0.004, tokens=[7])
    assert p.report.histogram == {1: 2} and p.report.committed_tokens == 2
    assert p._plain_steady.value == pytest.approx(0.004)  # the second followed a plain step
    assert p.report.fetched_experts == pytest.approx(6.0)
    assert p._plain_run == 2 and p._steps == 2 and len(p._history) == 2


def test_a_new_hybrid_placement_ends_the_plain_steps_decided_ahead():
    """While the guard's first check runs every step is plain and decided ahead; the step at which
    the guard keeps an arm goes through begin_step (which restarts the step-time measurements)."""
    kept = [None]
    p = planner(25.0, placement=lambda: kept[0])
    step(p)  # placing
    assert p._placing and p.decide_plain(8)
    p.end_step(1, 0, 1, 0.004, tokens=[1])
    assert p.report.placing_steps == 2
    kept[0] = "host"
    assert not p.decide_plain(8)
    step(p)
    assert p.report.placement_restarts == 1
