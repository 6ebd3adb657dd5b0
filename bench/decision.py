"""Statistics over the samples of ``bench-priority`` and its ship / no-ship decision: per-arm
intervals, paired differences, run-to-run noise and the instrumentation checks that guard the verdict."""

from __future__ import annotations

from pdflash.bench import stats as bstats
from pdflash.bench.config import BAND_NAMES

VERDICTS = ("ship", "no-ship", "inconclusive", "unmeasurable")


# -- statistics over samples ----------------------------------------------------------------------
SUMMARY_METRICS = (
    "exposed_fetch_s", "exposed_fetch_ms_per_step", "tokens_per_second", "tpot_ms", "acceptance_length",
    "hit_rate", "bytes_moved", "on_demand_stall_per_fetch_s", "exposed_fetch_total_s", "prefill_ms",
    "bytes_per_committed_token", "planner_predicted_step_ms", "planner_measured_step_ms", "planner_abs_error_ms",
)


def _values(samples: list[dict], arm: str, metric: str) -> list:
    return [s[metric] for s in samples if s["arm"] == arm]


def band_value(s: dict, band: str, key: str):
    lv = s.get("bands")
    return None if lv is None else lv[band][key]


def summarize(samples: list[dict], arms: tuple[str, ...], seed: int) -> dict:
    """{arm: {metric: {mean, lo, hi, n, median, missing}}}: 95 % bootstrap intervals of the mean."""
    out = {}
    for arm in arms:
        rows = [s for s in samples if s["arm"] == arm]
        m: dict = {}
        series = {k: [s[k] for s in rows] for k in SUMMARY_METRICS}
        for band in BAND_NAMES:
            for key in ("stall_s", "queue_wait_s", "bytes"):
                series[f"band.{band}.{key}"] = [band_value(s, band, key) for s in rows]
        for k, vals in series.items():
            m[k] = interval_of(vals, seed)
        hist: dict[str, int] = {}
        for r in rows:
            for b, n in (r.get("block_histogram") or {}).items():
                hist[b] = hist.get(b, 0) + n
        m["block_histogram"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
        m["samples"] = len(rows)
        out[arm] = m
    return out


def interval_of(vals: list, seed: int) -> dict:
    have = [float(v) for v in vals if v is not None]
    missing = len(vals) - len(have)
    if not have:
        return {"mean": None, "lo": None, "hi": None, "n": 0, "median": None, "missing": missing}
    iv = bstats.bootstrap_mean(have, seed=seed)
    srt = sorted(have)
    mid = len(srt) // 2
    med = srt[mid] if len(srt) % 2 else (srt[mid - 1] + srt[mid]) / 2
    return {**iv.as_dict(), "median": med, "missing": missing}


def paired(samples: list[dict], a: str, b: str, metric: str) -> tuple[list, list]:
    """Values of ``metric`` for arms a and b over the (repetition, prompt) pairs both ran."""
    by = {(s["arm"], s["repetition"], s["prompt"]): s[metric] for s in samples}
    keys = sorted({(s["repetition"], s["prompt"]) for s in samples if s["arm"] == a}
                  & {(s["repetition"], s["prompt"]) for s in samples if s["arm"] == b})
    return [by[(a, *k)] for k in keys], [by[(b, *k)] for k in keys]


def noise(samples: list[dict], arms: tuple[str, ...], metric: str) -> float | None:
    """Run-to-run noise of ``metric``: pooled SD of the same arm and prompt across repetitions."""
    groups: dict = {}
    for s in samples:
        if s["arm"] in arms:
            groups.setdefault((s["arm"], s["prompt"]), []).append(s[metric])
    return bstats.run_to_run_noise(groups)


def instrumentation_checks(samples: list[dict]) -> dict:
    """Guards against the original system's failure modes, computed from the samples.

    - ``exposed_fetch_instrumented``: in every prefetching or on-demand run with misses in the
      decode window, exposed fetch is a positive number (0.0 with misses means the wait points
      are not instrumented).
    - ``resident_exposed_fetch_zero``: the resident arm had no miss and no exposed fetch.
    - ``oracle_prediction_exact``: the oracle arm's replayed prediction covered every used expert.
    - ``same_tokens``: every run produced the reference tokens (oracle-acceptance mode).
    """
    checks: dict = {}
    bad = [s for s in samples if s["arm"] != "resident" and (s["misses"] or 0) > 0
           and not (s["exposed_fetch_s"] is not None and s["exposed_fetch_s"] > 0)]
    checks["exposed_fetch_instrumented"] = {"ok": not bad, "failing_runs": len(bad)}
    res = [s for s in samples if s["arm"] == "resident"]
    if res:
        worst = max((s["exposed_fetch_total_s"] or 0.0) for s in res)
        misses = sum((s["misses"] or 0) for s in res)
        checks["resident_exposed_fetch_zero"] = {"ok": misses == 0 and worst < 1e-3, "max_exposed_fetch_s": worst,
                                                 "misses": misses}
    orc = [s for s in samples if s["arm"] == "oracle" and s["route_ahead"]]
    if orc:
        recall = min(s["route_ahead"]["recall"] for s in orc)
        checks["oracle_prediction_exact"] = {"ok": recall == 1.0, "min_recall": recall}
    same = [s["same_tokens_as_reference"] for s in samples if s["same_tokens_as_reference"] is not None]
    if same:
        checks["same_tokens"] = {"ok": all(same), "differing_runs": same.count(False)}
    refresh = sum(s["oracle_refreshes"] or 0 for s in samples)
    checks["oracle_refreshes"] = {"ok": refresh == 0, "count": refresh,
                                  "note": "refresh forwards (oracle divergence repair) run inside the decode window"
                                  + ("; blocks of different lengths round apart in a 16-bit dtype unless every verify "
                                     "pass runs fixed rows (batch-invariant verify)" if refresh else "")}
    return checks


def make_decision(samples: list[dict], arms: tuple[str, ...], checks: dict, seed: int) -> tuple[bstats.Decision, dict]:
    """The verdict from the paired banded / flat samples (pairs = same repetition and prompt)."""
    missing_arms = [a for a in ("flat", "banded") if a not in arms]
    if missing_arms:
        d = bstats.Decision("unmeasurable", [f"the {' and '.join(missing_arms)} arm(s) did not run; "
                                             "the decision compares banded against flat"])
        return d, {}
    eb, ef = paired(samples, "banded", "flat", "exposed_fetch_s")
    if not checks["exposed_fetch_instrumented"]["ok"]:
        eb = [None] * len(eb)  # a 0.0 from an uninstrumented wait must not enter a comparison
    tb, tf = paired(samples, "banded", "flat", "tokens_per_second")
    ob, of = paired(samples, "banded", "flat", "on_demand_stall_per_fetch_s")
    tps_noise = noise(samples, ("flat", "banded"), "tokens_per_second")
    od_noise = noise(samples, ("flat", "banded"), "on_demand_stall_per_fetch_s")
    dec = bstats.decide(eb, ef, tb, tf, ob, of, tps_noise, od_noise, seed=seed)
    inputs = {"pairs": len(eb), "tokens_per_second_noise": tps_noise, "on_demand_stall_noise_s": od_noise}
    if not checks["exposed_fetch_instrumented"]["ok"]:
        dec.reasons.insert(0, "exposed fetch read 0 in runs that missed: the wait points are not instrumented")
    return dec, inputs


def paired_table(samples: list[dict], arms: tuple[str, ...], seed: int) -> dict:
    """Paired differences (mean, 95 % interval) of the main metrics: banded - flat, oracle - banded,
    flat - on-demand, banded - on-demand."""
    out = {}
    for a, b in (("banded", "flat"), ("oracle", "banded"), ("flat", "on-demand"), ("banded", "on-demand")):
        if a not in arms or b not in arms:
            continue
        row = {}
        for metric in ("exposed_fetch_s", "tokens_per_second", "on_demand_stall_per_fetch_s", "hit_rate", "bytes_moved"):
            xa, xb = paired(samples, a, b, metric)
            iv = bstats.paired_difference(xa, xb, seed=seed)
            row[metric] = iv.as_dict() if iv else None
        out[f"{a} - {b}"] = row
    return out
