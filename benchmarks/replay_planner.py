"""The block planner replayed on a simulated link-bound target (pdflash.draft.replay), CPU only.

    python benchmarks/replay_planner.py                                   # the planner, 48 seeds
    python benchmarks/replay_planner.py --fixed 1,2,4,8                   # and fixed block lengths
    python benchmarks/replay_planner.py --variant 'prev={"fetch_prediction": "route", "trial_from_plain": false,
        "probe_after_accept": null, "long_run_weight": 4.0}'             # a planner variant (BlockPlanner kwargs)

Per horizon (tokens committed per run), arm and oracle acceptance P: the mean and lowest tokens
per second over the seeds (the same seeds for every arm). A replay has no model and no GPU: it
shows what a planner change does to its choices in a regime measured on an H100, in seconds,
before a device run measures it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import import_pdflash  # noqa: E402

import_pdflash()

from pdflash.draft.planner import parse_variant  # noqa: E402
from pdflash.draft.replay import link_bound_run  # noqa: E402


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def replay(arms: dict[str, dict], acceptance: list[float], horizons: list[int], seeds: int) -> list[dict]:
    rows = []
    for horizon in horizons:
        for name, kw in arms.items():
            for p in acceptance:
                rates = [link_bound_run(p, seed, horizon=horizon, **kw).tokens_per_second for seed in range(seeds)]
                rows.append({"horizon": horizon, "arm": name, "acceptance": p, "mean_tokens_per_second": statistics.mean(rates),
                             "lowest_tokens_per_second": min(rates), "seeds": seeds})
    return rows


def markdown(rows: list[dict], acceptance: list[float]) -> str:
    head = "| tokens | arm | " + " | ".join(f"P = {p}: mean (lowest) tok/s" for p in acceptance) + " |"
    lines = [head, "|---:|---|" + "---:|" * len(acceptance)]
    keys = sorted({(r["horizon"], r["arm"]) for r in rows}, key=lambda k: (k[0], [r["arm"] for r in rows].index(k[1])))
    for horizon, arm in keys:
        cells = {r["acceptance"]: r for r in rows if r["horizon"] == horizon and r["arm"] == arm}
        lines.append(f"| {horizon} | {arm} | " + " | ".join(
            f"{cells[p]['mean_tokens_per_second']:.2f} ({cells[p]['lowest_tokens_per_second']:.2f})" for p in acceptance) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--acceptance", default="0.9,0.7,0.3", help="comma-separated oracle acceptance rates")
    ap.add_argument("--horizons", default="48,128", help="comma-separated tokens per run")
    ap.add_argument("--seeds", type=int, default=48)
    ap.add_argument("--fixed", default="", help="comma-separated fixed block lengths to run besides the planner")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=JSON: a planner arm with these BlockPlanner keyword arguments (repeatable)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = ap.parse_args(argv)
    try:
        acceptance, horizons, fixed = _floats(args.acceptance), _ints(args.horizons), _ints(args.fixed)
    except ValueError as exc:
        ap.error(f"--acceptance, --horizons and --fixed take comma-separated numbers ({exc})")
    if not acceptance or not all(0.0 <= p <= 1.0 for p in acceptance):
        ap.error("--acceptance: rates between 0 and 1")
    if not horizons or min(horizons) < 1 or args.seeds < 1:
        ap.error("--horizons and --seeds must be at least 1")
    if any(not 1 <= b <= 8 for b in fixed):
        ap.error("--fixed: block lengths 1 .. 8")
    arms: dict[str, dict] = {"auto": {}}
    for spec in args.variant:
        try:
            name, kw = parse_variant(spec)
        except ValueError as exc:
            ap.error(f"--variant {exc}")
        arms[name] = kw
    arms.update({f"B{b}": {"fixed": b} for b in fixed})
    try:
        rows = replay(arms, acceptance, horizons, args.seeds)
    except TypeError as exc:  # a variant naming no BlockPlanner argument
        ap.error(f"--variant: {exc}")
    print(json.dumps(rows, indent=1) if args.json else markdown(rows, acceptance))
    return 0


if __name__ == "__main__":
    sys.exit(main())
