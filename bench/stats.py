"""Paired statistics and the ship / no-ship decision of ``bench-priority``.

Samples are paired: the same (repetition, prompt) runs in every arm, so arm
differences are taken pair by pair and bootstrapped (resampling pairs with a
fixed seed). A metric that was not measured is ``None`` and never becomes 0:
any ``None`` in a needed metric makes the verdict "unmeasurable".
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass
class Interval:
    mean: float
    lo: float
    hi: float
    n: int

    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0

    def as_dict(self) -> dict:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "n": self.n}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def stdev(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def bootstrap_mean(xs: list[float], seed: int = 0, n_boot: int = 4000, level: float = 0.95) -> Interval:
    """Percentile bootstrap interval of the mean of xs."""
    if not xs:
        raise ValueError("bootstrap of an empty sample")
    rng = random.Random(seed)
    n = len(xs)
    boots = sorted(mean([xs[rng.randrange(n)] for _ in range(n)]) for _ in range(n_boot))
    a = (1 - level) / 2
    lo = boots[int(math.floor(a * (n_boot - 1)))]
    hi = boots[int(math.ceil((1 - a) * (n_boot - 1)))]
    return Interval(mean(xs), lo, hi, n)


def paired_difference(a: list[float | None], b: list[float | None], seed: int = 0) -> Interval | None:
    """Interval of mean(a_i - b_i) over pairs; None if any value is missing."""
    if len(a) != len(b) or not a or any(x is None for x in a) or any(x is None for x in b):
        return None
    return bootstrap_mean([x - y for x, y in zip(a, b)], seed=seed)


def run_to_run_noise(samples_by_key: dict[object, list[float]]) -> float | None:
    """Pooled standard deviation of repeated measurements of the same configuration
    (e.g. one arm on one prompt across repetitions): the noise floor of a metric."""
    groups = [v for v in samples_by_key.values() if len(v) >= 2 and all(x is not None for x in v)]
    if not groups:
        return None
    num = sum((len(g) - 1) * stdev(g) ** 2 for g in groups)
    den = sum(len(g) - 1 for g in groups)
    return math.sqrt(num / den) if den else None


@dataclass
class Decision:
    verdict: str  # "ship", "no-ship", "inconclusive" or "unmeasurable"
    reasons: list[str] = field(default_factory=list)
    conditions: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"verdict": self.verdict, "reasons": self.reasons, "conditions": self.conditions}


def decide(
    exposed_banded: list[float | None],
    exposed_flat: list[float | None],
    tps_banded: list[float | None],
    tps_flat: list[float | None],
    od_stall_banded: list[float | None],
    od_stall_flat: list[float | None],
    tps_noise: float | None,
    od_noise: float | None,
    seed: int = 0,
) -> Decision:
    """The route-ahead band ships only if, over paired samples,
    (1) banded's exposed fetch is lower than flat's, the 95 % bootstrap interval of the
        paired difference excluding zero;
    (2) banded's tokens/s is not lower than flat's beyond the measured run-to-run noise;
    (3) on-demand fetches are not slowed by the band (stall per on-demand fetch not higher
        beyond its noise).
    """
    d_exp = paired_difference(exposed_banded, exposed_flat, seed)
    d_tps = paired_difference(tps_banded, tps_flat, seed + 1)
    d_od = paired_difference(od_stall_banded, od_stall_flat, seed + 2)
    cond: dict = {
        "exposed_fetch_diff_s": d_exp.as_dict() if d_exp else None,
        "tokens_per_second_diff": d_tps.as_dict() if d_tps else None,
        "on_demand_stall_per_fetch_diff_s": d_od.as_dict() if d_od else None,
        "tokens_per_second_noise": tps_noise,
        "on_demand_stall_noise_s": od_noise,
    }
    missing = [
        name
        for name, v in (
            ("exposed fetch", d_exp),
            ("tokens/s", d_tps),
            ("on-demand stall per fetch", d_od),
            ("tokens/s run-to-run noise", tps_noise),
            ("on-demand stall run-to-run noise", od_noise),
        )
        if v is None
    ]
    if missing:
        return Decision("unmeasurable", [f"not measured: {', '.join(missing)}"], cond)

    reasons = []
    c1 = d_exp.hi < 0
    c1_worse = d_exp.lo > 0
    reasons.append(
        f"(1) exposed fetch banded - flat = {d_exp.mean * 1e3:+.2f} ms per run, 95% CI "
        f"[{d_exp.lo * 1e3:+.2f}, {d_exp.hi * 1e3:+.2f}] ms: "
        + ("lower, interval excludes zero" if c1 else "higher, interval excludes zero" if c1_worse else "interval includes zero")
    )
    c2 = not (d_tps.hi < 0 and -d_tps.mean > tps_noise)
    reasons.append(
        f"(2) tokens/s banded - flat = {d_tps.mean:+.3f}, 95% CI [{d_tps.lo:+.3f}, {d_tps.hi:+.3f}], "
        f"noise {tps_noise:.3f}: " + ("not lower beyond noise" if c2 else "lower beyond noise")
    )
    c3 = not (d_od.lo > 0 and d_od.mean > od_noise)
    reasons.append(
        f"(3) on-demand stall per fetch banded - flat = {d_od.mean * 1e6:+.1f} us, 95% CI "
        f"[{d_od.lo * 1e6:+.1f}, {d_od.hi * 1e6:+.1f}] us, noise {od_noise * 1e6:.1f} us: "
        + ("not slowed" if c3 else "slowed beyond noise")
    )
    cond.update({"exposed_fetch_lower": c1, "tokens_per_second_held": c2, "on_demand_not_slowed": c3})
    if c1 and c2 and c3:
        return Decision("ship", reasons, cond)
    if c1_worse or not c2 or not c3:
        return Decision("no-ship", reasons, cond)
    return Decision("inconclusive", reasons, cond)
