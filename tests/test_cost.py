"""The shared cost model (offload/cost.py): rates from measurements, priors before them."""

import pytest

from pdflash.offload.cost import LINK_PRIOR_BYTES_PER_S, CostModel


class FakeCache:
    def __init__(self, states):
        self.states = states

    def state_of(self, layer, expert):
        return self.states.get((layer, expert))


def test_link_rate_prior_then_measured():
    m = CostModel(1000, device_type="cuda")
    assert m.link_bytes_per_s == LINK_PRIOR_BYTES_PER_S["cuda"] and not m.link_measured
    assert CostModel(1000, link_gbps=2).link_bytes_per_s == 2e9
    assert m.observe_link(0, 0.0) is None  # first call: only a starting point
    assert m.observe_link(4e6, 0.002) == pytest.approx(2e9)
    assert m.link_measured and m.link_bytes_per_s == pytest.approx(2e9)
    m.observe_link(8e6, 0.003)  # 4 MB in 1 ms: 4 GB/s enters the EWMA
    assert 2e9 < m.link_bytes_per_s < 4e9
    assert m.observe_link(0, 0.0) is None  # counters reset: the interval restarts
    assert m.seconds_per_expert_fetch() == pytest.approx(1000 / m.link_bytes_per_s)


def test_observe_scheduler_sums_bands():
    m = CostModel(10, link_gbps=1)
    m.observe_scheduler({"levels": [{"bytes": 0}, {"bytes": 0}], "link_busy_s": 0.0})
    m.observe_scheduler({"levels": [{"bytes": 3e6}, {"bytes": 1e6}], "link_busy_s": 0.001})
    assert m.link_bytes_per_s == pytest.approx(4e9)


def test_forward_time_removes_own_link_time_and_uses_nearest():
    m = CostModel(1_000_000, link_gbps=1)  # 1 ms per expert
    assert m.forward_seconds("verify", 4) is None and m.step_seconds("verify", 4, 3) is None
    m.observe_forward("verify", 4, 0.010, fetched_experts=5)  # 5 ms of it was the link
    assert m.forward_seconds("verify", 4) == pytest.approx(0.005)
    assert m.forward_seconds("verify", 3) == pytest.approx(0.005)  # nearest measured
    assert m.step_seconds("verify", 4, 2) == pytest.approx(0.007)
    m.observe_forward("verify", 1, 0.002)
    assert m.forward_seconds("verify", 2) == pytest.approx(0.003)  # between 1 and 4: interpolated
    assert m.forward_seconds("verify", 8) == pytest.approx(0.005)
    with pytest.raises(ValueError):
        m.observe_forward("bogus", 1, 0.1)


def test_serve_counts_resident_in_flight_missing():
    m = CostModel(1_000_000, link_gbps=1)
    cache = FakeCache({(0, 1): "resident", (0, 2): "arriving"})
    plan = m.serve([(0, 1), (0, 2), (0, 3), (1, 3), (0, 3)], cache)
    assert (plan.resident, plan.in_flight, plan.to_fetch, plan.host) == (1, 1, 2, 0)
    assert plan.seconds == pytest.approx(2.5e-3)  # in flight counts half a fetch


def test_host_hook_takes_misses_only_when_sooner():
    m = CostModel(1_000_000, link_gbps=1)  # 1 ms per fetch
    cache = FakeCache({})
    m.set_cpu_expert_rate(lambda tokens: 0.0004 * tokens)
    plan = m.serve([(0, 1), (0, 2)], cache, tokens=1)
    assert (plan.host, plan.to_fetch) == (2, 0) and plan.seconds == pytest.approx(8e-4)
    plan = m.serve([(0, 1), (0, 2)], cache, tokens=4)  # 1.6 ms on the host: fetch instead
    assert (plan.host, plan.to_fetch) == (0, 2) and plan.seconds == pytest.approx(2e-3)
    m.set_cpu_expert_rate(None)
    assert m.serve([(0, 1)], cache).host == 0
    m.set_cpu_expert_rate(lambda tokens: None)  # a hook with no price yet (not measured)
    assert m.serve([(0, 1)], cache).host == 0


@pytest.mark.parametrize("arm,one,four", [
    ("off", 1e-3, 1e-3),  # every miss fetched
    ("host", 4e-4, 1.6e-3),  # every miss on the host, however slow
    ("all", 4e-4, 1.6e-3),
    ("model", 1e-3 * 4e-4 / 1.4e-3, 1e-3 * 1.6e-3 / 2.6e-3),  # both pipes side by side
    (None, 1e-3 * 4e-4 / 1.4e-3, 1e-3 * 1.6e-3 / 2.6e-3),  # no placement hook: the cost model's split
])
def test_a_missing_expert_is_priced_by_the_placement_that_serves_it(arm, one, four):
    m = CostModel(1_000_000, link_gbps=1)  # 1 ms per fetch
    m.set_cpu_expert_rate(lambda tokens: 0.0004 * tokens, placement=None if arm is None else (lambda tokens: arm))
    m.observe_forward("verify", 4, 0.002)
    assert m.placement_of(4) == (arm or "model")
    assert m.seconds_per_missing_expert(1) == pytest.approx(one)
    assert m.step_seconds("verify", 4, 2) == pytest.approx(0.002 + 2 * four)


@pytest.mark.parametrize("arm,base", [("host", 0.010 - 2e-3 - 5 * 4e-4), ("model", 0.010 - 2e-3), ("off", 0.010 - 2e-3)])
def test_a_forward_is_recorded_without_the_time_serving_its_misses(arm, base):
    """host: the link's and the host's shares add up; model: they overlap (the longer one counts);
    off: the host computed nothing, but the hook may still price it (only the link is taken off)."""
    m = CostModel(1_000_000, link_gbps=1)
    m.set_cpu_expert_rate(lambda tokens: 0.0004 * tokens, placement=lambda tokens: arm)
    m.observe_forward("plain", 1, 0.010, fetched_experts=2, host_experts=0 if arm == "off" else 5)
    assert m.forward_seconds("plain", 1) == pytest.approx(base)


def test_forward_time_is_robust_to_one_slow_step():
    m = CostModel(1000, link_gbps=1)
    for t in (0.5, 0.010, 0.011, 0.012):  # a first call's warm-up, then steady steps
        m.observe_forward("plain", 1, t)
    assert m.forward_seconds("plain", 1) == pytest.approx(0.0115)
    for _ in range(8):
        m.observe_forward("plain", 1, 0.020)
    assert m.forward_seconds("plain", 1) == pytest.approx(0.020)  # the window moved on


def test_expert_compute_rate():
    m = CostModel(100)
    assert m.device_expert_seconds(1) is None
    m.observe_expert_compute(1, 4, 0.002)
    assert m.device_expert_seconds(2) == pytest.approx(0.0005)
    d = m.to_dict()
    assert d["device_expert_ms"] == {1: pytest.approx(0.5)} and d["host_path"] is False and d["placement"] == "off"


def test_place_layer_without_host_fetches_everything():
    m = CostModel(1_000_000, link_gbps=1)  # 1 ms per fetch
    plan = m.place_layer({3: 1, 5: 2}, in_flight=1)
    assert plan.host == [] and sorted(plan.fetch) == [3, 5]
    assert plan.device_seconds == pytest.approx(0.5e-3 + 2e-3) and plan.seconds == plan.device_seconds


def test_place_layer_balances_host_and_link():
    m = CostModel(1_000_000, link_gbps=1)  # 1 ms per fetch
    m.set_cpu_expert_rate(lambda tokens: 0.4e-3 * tokens)
    # five one-token experts: k on the host costs 0.4k ms, the rest 1 ms each on the link
    plan = m.place_layer({e: 1 for e in range(5)})
    assert len(plan.host) == 4 and len(plan.fetch) == 1
    assert plan.host_seconds == pytest.approx(1.6e-3) and plan.device_seconds == pytest.approx(1e-3)
    # the cheapest on the host go first: many tokens make an expert dear on the host
    plan = m.place_layer({0: 1, 1: 9, 2: 1})
    assert sorted(plan.host) == [0, 2] and plan.fetch == [1]
    # what is in flight delays the link: more goes to the host
    busy = m.place_layer({e: 1 for e in range(5)}, in_flight=4)
    assert len(busy.host) == 5 and busy.fetch == []
    # a fast link keeps everything there
    fast = CostModel(1_000, link_gbps=1)  # 1 us per fetch
    fast.set_cpu_expert_rate(lambda tokens: 0.4e-3 * tokens)
    assert fast.place_layer({e: 1 for e in range(5)}).host == []


def test_place_layer_pays_the_measured_host_overhead_once():
    m = CostModel(1_000_000, link_gbps=1)  # 1 ms per fetch
    m.set_cpu_expert_rate(lambda tokens: 0.4e-3 * tokens)
    m.observe_host_overhead(0.5e-3)  # handing a layer's share to the host costs 0.5 ms
    plan = m.place_layer({e: 1 for e in range(5)})
    # k on the host: 0.5 + 0.4k ms against 5 - k ms on the link -> k = 3 (1.7 vs 2 ms)
    assert len(plan.host) == 3 and plan.host_seconds == pytest.approx(1.7e-3)
    m.observe_host_overhead(50e-3)  # an overhead far above the link time: nothing goes to the host
    for _ in range(30):
        m.observe_host_overhead(50e-3)
    assert m.place_layer({e: 1 for e in range(5)}).host == []
    m.observe_host_overhead(-1.0)  # a negative measurement is ignored
    assert m.host_layer_overhead.value > 0


def test_place_layer_counts_the_devices_work():
    m = CostModel(1_000_000, link_gbps=1)  # 1 ms per fetch
    m.set_cpu_expert_rate(lambda tokens: 1.5e-3)
    m.observe_expert_compute(1, 1, 2e-3)  # the device takes 2 ms per expert
    # 3 resident experts keep the device busy 6 ms: fetched misses would end at 6 + 2 + 2 ms,
    # while the host computes both in 3 ms beside the device's 6
    plan = m.place_layer({7: 1, 8: 1}, resident_tokens=[1, 1, 1])
    assert plan.host == [7, 8] and plan.device_seconds == pytest.approx(0.006) and plan.seconds == pytest.approx(0.006)
    # with nothing resident the device waits for the link, and the host takes one
    plan = m.place_layer({7: 1, 8: 1})
    assert len(plan.host) == 1 and plan.seconds == pytest.approx(max(1.5e-3, 1e-3 + 2e-3))
