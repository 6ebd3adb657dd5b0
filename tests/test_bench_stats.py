"""The ship / no-ship decision on constructed samples with known answers."""

import random

from pdflash.bench.stats import bootstrap_mean, decide, paired_difference, run_to_run_noise


def _noisy(base, n, sd, seed):
    rng = random.Random(seed)
    return [base + rng.gauss(0, sd) for _ in range(n)]


def test_bootstrap_interval_covers_mean_and_shrinks_with_n():
    small = bootstrap_mean(_noisy(1.0, 10, 0.1, 1))
    large = bootstrap_mean(_noisy(1.0, 400, 0.1, 1))
    assert small.lo <= small.mean <= small.hi
    assert (large.hi - large.lo) < (small.hi - small.lo)
    assert large.lo < 1.0 < large.hi


def test_paired_difference_missing_value_is_none():
    assert paired_difference([1.0, None], [1.0, 2.0]) is None
    assert paired_difference([], []) is None


def test_noise_is_pooled_within_groups():
    noise = run_to_run_noise({"a": [1.0, 1.2, 0.8], "b": [10.0, 10.2, 9.8]})
    assert abs(noise - 0.2) < 1e-9  # the 9-unit gap between groups is not noise


def _decide(exp_b, exp_f, tps_b=None, tps_f=None, od_b=None, od_f=None):
    n = len(exp_b)
    tps_b = tps_b or [10.0] * n
    tps_f = tps_f or [10.0] * n
    od_b = od_b or [1e-3] * n
    od_f = od_f or [1e-3] * n
    return decide(exp_b, exp_f, tps_b, tps_f, od_b, od_f, tps_noise=0.1, od_noise=1e-4)


def test_ship_when_banded_clearly_lower():
    flat = _noisy(0.50, 20, 0.01, 2)
    banded = [x - 0.1 for x in flat]
    d = _decide(banded, flat)
    assert d.verdict == "ship", d.reasons


def test_no_ship_when_banded_higher():
    flat = _noisy(0.50, 20, 0.01, 3)
    d = _decide([x + 0.1 for x in flat], flat)
    assert d.verdict == "no-ship"


def test_inconclusive_when_interval_includes_zero():
    flat = _noisy(0.50, 20, 0.05, 4)
    banded = [x + random.Random(i).choice([-0.02, 0.02]) for i, x in enumerate(flat)]
    d = _decide(banded, flat)
    assert d.verdict == "inconclusive", d.reasons


def test_no_ship_when_tokens_per_second_drop_beyond_noise():
    flat = _noisy(0.50, 20, 0.01, 5)
    d = _decide([x - 0.1 for x in flat], flat, tps_b=[9.0] * 20, tps_f=[10.0] * 20)
    assert d.verdict == "no-ship"
    assert not d.conditions["tokens_per_second_held"]


def test_no_ship_when_on_demand_slowed():
    flat = _noisy(0.50, 20, 0.01, 6)
    d = _decide([x - 0.1 for x in flat], flat, od_b=[2e-3] * 20, od_f=[1e-3] * 20)
    assert d.verdict == "no-ship"
    assert not d.conditions["on_demand_not_slowed"]


def test_unmeasurable_when_metric_missing():
    d = _decide([None] * 5, [0.5] * 5)
    assert d.verdict == "unmeasurable"
    assert "exposed fetch" in d.reasons[0]
