"""The block planner (--block-size auto): its choices follow measured acceptance and costs."""

import pytest

from pdflash.draft.planner import AcceptanceModel, BlockPlanner, distinct_experts, expected_committed
from pdflash.offload.cost import CostModel, Ewma, RecentMedian

L, E, K = 4, 32, 4
EXPERT_BYTES = 1_000_000


class FakeCache:
    capacity = 32

    def __init__(self):
        self.resident = set()

    def state_of(self, layer, expert):
        return "resident" if (layer, expert) in self.resident else None


def planner(link_gbps, max_block=8, **kw):
    cost = CostModel(EXPERT_BYTES, link_gbps=link_gbps)
    return BlockPlanner(max_block, cost, num_layers=L, num_experts=E, top_k=K, cache=FakeCache(), **kw)


def teach(p, accept_rate, steps=40):
    """Feed measured steps: forward times flat in B (GPU-like), fetched experts growing with the
    union of the block's experts, and acceptance at ``accept_rate`` per position."""
    for i in range(steps):
        for block in (1, p.max_block):
            p.begin_step()
            fetched = L * distinct_experts(block, E, K)
            p.cost.observe_forward("verify", block, 0.005 + fetched * p.cost.seconds_per_expert_fetch(), fetched)
            if block == 1:  # plain decoding's steady steps
                p._plain_steady.add(0.005 + fetched * p.cost.seconds_per_expert_fetch())
            p.cost.observe_forward("draft", block, 0.001)
            if block > 1:
                accepted = 0
                while accepted < block - 1 and (i * 7 + accepted * 3) % 100 < accept_rate * 100:
                    accepted += 1
                p.acceptance.record(block - 1, accepted)
            p._extra.setdefault(block, Ewma()).add(fetched)


def test_expected_committed_and_distinct_experts():
    assert expected_committed([0.5, 0.5, 0.5], 1) == 1.0
    assert expected_committed([0.5, 0.5, 0.5], 4) == pytest.approx(1.875)
    assert distinct_experts(1, 32, 4) == pytest.approx(4.0)
    assert [round(distinct_experts(b, 32, 4), 1) for b in (2, 4)] == [7.5, 13.2]  # the figures
    assert distinct_experts(8, 32, 4) == pytest.approx(20.9, abs=0.2)


def test_acceptance_model_conditional_and_calibration():
    m = AcceptanceModel(3, prior_mean=0.5, prior_weight=2)
    assert m.conditional() == [0.5, 0.5, 0.5]
    for _ in range(18):
        m.record(3, 3, confidence=[0.95, 0.95, 0.95])
    for _ in range(18):
        m.record(3, 0, confidence=[0.05, 0.05, 0.05])
    cond = m.conditional()
    assert cond[0] == pytest.approx((18 + 1) / (36 + 2))
    assert cond[1] > 0.9  # reached only when position 1 was accepted, and always accepted then
    hi, lo = m.calibrated([0.96, 0.96])[0], m.calibrated([0.04, 0.04])[0]
    assert hi > 0.9 and lo < 0.1


def test_slow_link_and_low_acceptance_choose_plain_decoding():
    p = planner(link_gbps=0.1)  # 10 ms per expert
    teach(p, accept_rate=0.2)
    p.begin_step()
    assert p.plan_draft(8) == 1
    assert p.current().block == 1 and p.current().predicted_seconds > 0


def test_cheap_link_and_high_acceptance_choose_long_blocks():
    p = planner(link_gbps=1000)
    teach(p, accept_rate=0.95)
    p.begin_step()
    assert p.plan_draft(8) == 8
    choice = p.choose(8, None, 0.001)
    assert choice.block >= 6 and choice.expected_tokens > 4


def test_draft_confidence_shortens_the_block():
    p = planner(link_gbps=2, use_confidence=True)
    teach(p, accept_rate=0.9)
    for _ in range(30):  # the draft is right when confident, wrong when not
        p.acceptance.record(7, 7, confidence=[0.9] * 7)
        p.acceptance.record(7, 0, confidence=[0.1] * 7)
    p.begin_step()
    assert p.plan_draft(8) == 8
    confident = p.choose(8, [0.9] * 7, 0.001).block
    unsure = p.choose(8, [0.9, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], 0.001).block
    assert unsure < confident and unsure <= 2


def test_cold_start_measures_plain_then_a_full_block_and_probes():
    p = planner(link_gbps=2, probe_every=3)
    p.begin_step()
    assert p.plan_draft(8) == 1  # nothing measured: a plain step first ...
    p.end_step(1, 0, 1, 0.03)
    p.begin_step()
    assert p.plan_draft(8) == 1  # ... and a second, the price of steady plain decoding
    p.end_step(1, 0, 1, 0.01)
    p.begin_step()
    assert p.plan_draft(8) == 8  # then a full draft ...
    assert p.choose(8, None, 0.002).block == 4  # ... of which a block of half its length is verified
    p.end_step(4, 0, 1, 0.5, draft_seconds=0.002)  # slow, and nothing accepted
    blocks = []
    for _ in range(11):
        p.begin_step()
        b = p.plan_draft(8)
        if b > 1:
            b = p.choose(b, None, 0.002).block
        blocks.append(b)
        p.end_step(b, 0, 1, 0.01 if b == 1 else 0.5, draft_seconds=0.002 if b > 1 else 0.0)
    # probes after 3, then 6 plain steps in a row: the interval doubles while plain stays ahead
    assert [b > 1 for b in blocks] == [False, False, True, False, False, False, False, False, True, False, False], blocks
    assert p.report.probes == 2
    rep = p.to_dict()
    assert sum(rep["block_histogram"].values()) == 14 and rep["predicted_steps"] >= 11


def test_a_plain_step_is_remeasured_among_long_speculative_runs():
    p = planner(link_gbps=1000, remeasure_plain_every=5)
    teach(p, accept_rate=0.95)
    steady = p._plain_steady.count
    chosen = []
    for _ in range(12):
        p.begin_step()
        b = p.plan_draft(8)
        chosen.append(b)
        p.end_step(b, b - 1, b, 0.006 if b == 1 else 0.01, draft_seconds=0.001 if b > 1 else 0.0)
    assert chosen == [8, 8, 8, 8, 1, 1, 8, 8, 8, 8, 1, 1]  # two plain steps: the second is the steady one
    assert p._plain_steady.count == steady + 2


def test_plain_decoding_is_priced_by_its_steady_steps_not_the_first_after_speculation():
    """The first plain step after wide verify blocks refetches what they evicted; the planner
    prices B = 1 by plain steps that followed a plain step."""
    p = planner(link_gbps=1000, remeasure_plain_every=5)
    teach(p, accept_rate=0.5)
    p._plain_steady = RecentMedian()
    for b, seconds in ((8, 0.05), (1, 0.04), (1, 0.01), (1, 0.012)):  # transition 40 ms, steady 10-12 ms
        p.begin_step()
        p.end_step(b, 0, 1, seconds, draft_seconds=0.001 if b > 1 else 0.0)
    assert p._plain_steady.value == pytest.approx(0.011)
    assert p._candidate(1, [], None).predicted_seconds == pytest.approx(0.011)


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
    assert p.fetch_experts(8) == (3.0, pytest.approx(3.0 * 1))  # no more history: the same set


def test_own_clock_replaces_the_callers_step_times():
    now = [0.0]
    p = planner(link_gbps=1000, clock=lambda: now[0])
    p.begin_step()
    assert p.plan_draft(8) == 1
    now[0] += 0.004
    p.end_step(1, 0, 1, seconds=9.0)  # a wall time stretched by another process: ignored
    assert p.last_measured_seconds == pytest.approx(0.004)
    assert p.cost.measured_forward("verify") == {1: pytest.approx(0.004)}
    p.begin_step()
    assert p.plan_draft(8) == 1  # the second plain step of the cold start
    now[0] += 0.004
    p.end_step(1, 0, 1, seconds=9.0)
    p.begin_step()
    assert p.plan_draft(8) == 8
    now[0] += 0.001
    p.choose(8, None, draft_seconds=5.0)
    now[0] += 0.006
    p.end_step(8, 7, 8, seconds=9.0, draft_seconds=5.0)
    assert p.cost.measured_forward("draft") == {8: pytest.approx(0.001)}
    assert p.cost.measured_forward("verify")[8] == pytest.approx(0.006)
    assert p.to_dict()["step_clock"] == "<lambda>"


def test_repeating_text_brings_the_probe_forward():
    p = planner(link_gbps=0.1, probe_every=16, min_repeat_gap=4)  # 10 ms per expert
    teach(p, accept_rate=0.2)
    for _ in range(8):
        p._plain_steady.add(0.01)  # plain steps measured at 10 ms: plain decoding is far ahead
    blocks = []
    for i in range(10):
        p.begin_step()
        b = p.plan_draft(8, repeating=i >= 2)  # the text starts repeating itself at step 2
        blocks.append(b)
        if b > 1:
            b = p.choose(b, None, 0.002).block
        p.end_step(b, 0, 1, 0.01 if b == 1 else 0.05, draft_seconds=0.002 if b > 1 else 0.0)
    # plain, then one early probe after 4 plain steps; it accepted nothing, so the next early
    # probe waits twice as long (8 plain steps: beyond these 10)
    assert [b > 1 for b in blocks] == [False, False, False, True, False, False, False, False, False, False], blocks
    assert p._repeat_gap == 8
    assert p._probe_interval == 16  # early probes leave the doubling interval alone
    for _ in range(4):  # the next one comes; its proposal is accepted: the gap is back to 4
        p.begin_step()
        b = p.plan_draft(8, repeating=True)
        if b > 1:
            b = p.choose(b, None, 0.002).block
        p.end_step(b, 1 if b > 1 else 0, 2 if b > 1 else 1, 0.01 if b == 1 else 0.05, draft_seconds=0.002 if b > 1 else 0.0)
    assert p._repeat_gap == 4


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


def _measured_plain(p, seconds=0.01, steps=2):
    for _ in range(steps):
        p.begin_step()
        assert p.plan_draft(8) == 1
        p.end_step(1, 0, 1, seconds)


def test_realized_speculation_outranks_a_pessimistic_prediction():
    """The model predicts plain decoding (slow link, low acceptance taught); the draft's steps
    have realized several times plain decoding's tokens per second: the planner keeps drafting."""
    p = planner(link_gbps=0.1)  # 10 ms per expert
    teach(p, accept_rate=0.2)
    p.begin_step()
    assert p.plan_draft(8) == 1  # what the prediction alone says (as in the test above)
    p.end_step(1, 0, 1, p._plain_steady.value)
    plain_rate = 1.0 / p._plain_steady.value
    p._drafting = True  # a probe's block that committed 4 tokens at 4x plain decoding's rate
    p.end_step(4, 3, 4, 1.0 / plain_rate)
    assert p._speculation_pays() is True
    for _ in range(4):
        p.begin_step()
        assert p.plan_draft(8) == 8
        b = p.choose(8, None, 0.002).block
        p.end_step(b, b - 1, b, b / (4 * plain_rate), draft_seconds=0.002)
    assert p._speculation_pays() is True


def test_realized_loss_stops_drafting_until_the_next_probe():
    """The model predicts long blocks (fast link, high acceptance taught); the draft's steps have
    realized fewer tokens per second than plain decoding: plain steps until a probe."""
    p = planner(link_gbps=1000, probe_every=6)
    teach(p, accept_rate=0.95)
    p.begin_step()
    assert p.plan_draft(8) == 8  # predicted to pay
    p.choose(8, None, 0.002)
    p.end_step(8, 0, 1, 0.05, draft_seconds=0.002)  # realized: 20 tok/s against plain's 200
    assert p._speculation_pays() is False
    blocks = []
    for _ in range(6):
        p.begin_step()
        b = p.plan_draft(8)
        blocks.append(b)
        p.end_step(b, 0, 1, 0.005 if b == 1 else 0.05, draft_seconds=0.002 if b > 1 else 0.0)
    assert blocks == [1, 1, 1, 1, 1, 8], blocks  # plain until the probe after 6 plain steps in a row


def test_a_drafted_step_that_verifies_one_token_is_not_a_plain_step():
    p = planner(link_gbps=1000)
    _measured_plain(p, seconds=0.01, steps=2)
    steady = list(p._plain_steady.samples)
    p.begin_step()
    assert p.plan_draft(8) == 8  # the cold start's block
    p.end_step(1, 0, 1, 0.03, draft_seconds=0.02)  # the draft ran, stage 2 kept one token
    assert p._plain_steady.samples == steady  # its draft time does not price plain decoding
    assert p._spec_rate.value == pytest.approx(1 / 0.03)
