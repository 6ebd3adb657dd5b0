"""`pdflash generate` as a new user runs it: the default (speculative, --block-size auto) against
--no-draft, one fresh process per run, on a set of prompts, in alternating order.

    python benchmarks/bench_default_vs_plain.py --out default_vs_plain.json
    python benchmarks/bench_default_vs_plain.py --repeats 3 -- --expert-cache-experts 64 --link-gbps 2

Arguments after ``--`` go to both commands (default: the `make demo` setting,
``--expert-cache-experts 64 --link-gbps 2``); ``--default-args`` to the default arm only. Per prompt and repeat both commands run with
``--json --max-new-tokens N`` (order alternating by repeat); the ratio is default tokens/s over
--no-draft tokens/s of the same repeat. Reports per prompt the median ratio, the block lengths
the planner chose, acceptance, and whether both produced the same tokens; overall the median and
geometric mean of the per-prompt ratios and the lowest one.

``--warmup N`` (default 1) first runs each command N times on the first prompt, results discarded:
the machine's first pdflash process pays for cold caches (on an H100 machine the first `generate`
ran at 84-92 tok/s against about 600 later, 0.13-0.14x in the first pair of two calls).

``--trace`` runs both commands with ``generate --trace`` and takes each run's steps apart
(``step_breakdown``): per block length of the default arm its steps' mean verify and draft time,
the time between steps outside both (the loop's own work: the planner, acceptance, bookkeeping)
and the shadow probes, against --no-draft's mean step; where the default loses, that says whether
its plain steps, its blocks or its loop cost the time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = (  # the three, then held-out ones: code the draft did not see, and prose
    "def fibonacci(n):",
    "class Parser:",
    "import os",
    "def read_config(path):\n    with open(path) as f:",
    "for i in range(10):",
    "The river flows",
    "Once upon a time",
    "Hello, my name is",
)
DEFAULT_ARGS = ["--expert-cache-experts", "64", "--link-gbps", "2"]


def run(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def guard_summary(report: dict) -> dict | None:
    """What auto's hybrid guard did in one run (``generate --json``): the arm it ran each of its
    first traced steps under, the arm it ended on, its completed checks, and the CPU kernel's
    calibrated rate against the link's, which set the order the arms are tried in
    (``cpu_compute.guard_order``); None without a guard."""
    ce = report.get("cpu_experts") or {}
    guard = ce.get("guard")
    if not guard:
        return None
    return {"arms": [t["arm"] for t in guard.get("trace", [])], "arm": guard.get("arm"), "checks": guard.get("checks"),
            "cpu_gbps": ce.get("gbps"), "link_gbps": report.get("link_gbps")}


def step_breakdown(lines: list[dict]) -> dict:
    """One run's ``generate --trace`` lines taken apart. The first line has no step time (nothing
    before it is a step) and is left out of the means. Speculative runs (lines with a block):
    steps, shadow probes, per block length B its steps and mean verify / draft ms, and the mean time
    per step outside draft and verify; plain runs: steps and mean step ms. Medians beside the
    means (verify per B, plain steps): the hybrid guard's first check runs some steps under arms
    several times slower, which move a mean."""
    timed = [r for r in lines if r.get("step_ms") is not None]
    if not lines or "block" not in lines[0]:
        return {"steps": len(lines), "step_ms": statistics.mean(r["step_ms"] for r in timed) if timed else None,
                "step_median_ms": statistics.median(r["step_ms"] for r in timed) if timed else None}
    per_block: dict[str, dict] = {}
    for b in sorted({r["block"] for r in timed}):
        rs = [r for r in timed if r["block"] == b]
        per_block[str(b)] = {"steps": len(rs), "verify_ms": statistics.mean(r["verify_ms"] for r in rs),
                             "verify_median_ms": statistics.median(r["verify_ms"] for r in rs),
                             "draft_ms": statistics.mean(r["draft_ms"] for r in rs),
                             "step_ms": statistics.mean(r["step_ms"] for r in rs)}
    return {"steps": len(lines), "shadow_probes": sum(1 for r in lines if r.get("shadow")),
            "step_ms": statistics.mean(r["step_ms"] for r in timed) if timed else None,
            "outside_ms": statistics.mean(r["step_ms"] - r["draft_ms"] - r["verify_ms"] for r in timed) if timed else None,
            "per_block": per_block}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = DEFAULT_ARGS
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--pdflash", default=f"{sys.executable} -m pdflash.cli.main", help="How to run pdflash.")
    ap.add_argument("--default-args", default="", help="Extra arguments of the default (speculative) arm only, "
                    "e.g. '--route-ahead-predictor none'.")
    ap.add_argument("--warmup", type=int, default=1, help="Untimed runs of each command on the first prompt first.")
    ap.add_argument("--trace", action="store_true", help="Take every run's steps apart (generate --trace).")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.warmup < 0:
        ap.error("--warmup must be 0 or more")
    base = args.pdflash.split()
    with tempfile.TemporaryDirectory(prefix="pdflash-traces-") as tmp:
        return _run(args, base, extra, Path(tmp) if args.trace else None)


def _run(args, base: list[str], extra: list[str], traces: Path | None) -> int:
    """Every prompt and repeat, both arms; ``traces``: where the runs' --trace files go (removed after)."""
    rows = []
    for _ in range(args.warmup):  # cold caches of a machine's first processes, left out
        for arm_args in (["--no-draft"], args.default_args.split()):
            run(base + ["generate", PROMPTS[0], "--max-new-tokens", str(args.max_new_tokens), "--json", *extra, *arm_args])
    for pi, prompt in enumerate(PROMPTS[: args.prompts]):
        for rep in range(args.repeats):
            arms = ["default", "no-draft"] if rep % 2 == 0 else ["no-draft", "default"]
            got = {}
            for arm in arms:
                cmd = base + ["generate", prompt, "--max-new-tokens", str(args.max_new_tokens), "--json", *extra]
                if arm == "no-draft":
                    cmd.append("--no-draft")
                else:
                    cmd += args.default_args.split()
                trace = traces / f"{pi}_{rep}_{arm}.jsonl" if traces is not None else None
                if trace is not None:
                    cmd += ["--trace", str(trace)]
                t0 = time.perf_counter()
                got[arm] = run(cmd)
                got[arm]["wall_s"] = time.perf_counter() - t0
                if trace is not None:
                    lines = trace.read_text().splitlines()
                    got[arm]["trace"] = [json.loads(line) for line in lines]
                    got[arm]["steps"] = step_breakdown(got[arm]["trace"])
            d, p = got["default"], got["no-draft"]
            row = {"prompt": prompt, "repeat": rep, "default_tps": d["tokens_per_second"],
                   "no_draft_tps": p["tokens_per_second"], "ratio": d["tokens_per_second"] / p["tokens_per_second"],
                   "same_tokens": d["token_ids"] == p["token_ids"], "block_histogram": d.get("block_histogram"),
                   "acceptance_length": d.get("acceptance_length"), "probes": (d.get("planner") or {}).get("probes"),
                   "retreats": (d.get("planner") or {}).get("retreats"),
                   "predicted_step_ms": (d.get("planner") or {}).get("predicted_step_ms"),
                   "measured_step_ms": (d.get("planner") or {}).get("measured_step_ms"),
                   "bytes_per_committed_token": d.get("bytes_per_committed_token"),
                   "no_draft_bytes_per_token": p.get("bytes_per_token"),
                   "default_guard": guard_summary(d), "no_draft_guard": guard_summary(p)}
            if traces is not None:
                row["default_steps"], row["no_draft_steps"] = d["steps"], p["steps"]
                row["default_trace"], row["no_draft_trace"] = d["trace"], p["trace"]  # every step, for a later look
            rows.append(row)
            print(f"{prompt!r} rep {rep}: default {row['default_tps']:.1f} tok/s, --no-draft {row['no_draft_tps']:.1f}, "
                  f"ratio {row['ratio']:.2f}, blocks {row['block_histogram']}, accept {row['acceptance_length']:.2f}, "
                  f"same tokens {row['same_tokens']}", file=sys.stderr, flush=True)
            for arm in ("default", "no_draft"):
                g = row[f"{arm}_guard"]
                if g:
                    first = g["arms"][0] if g["arms"] else None
                    print(f"    guard ({arm}): first arm {first}, ended on {g['arm']} after {g['checks']} check(s); "
                          f"CPU kernel {g['cpu_gbps'] or 0:.2f} GB/s, link {g['link_gbps'] or 0:.2f} GB/s",
                          file=sys.stderr, flush=True)
            if traces is not None:
                ds, ps = d["steps"], p["steps"]
                blocks = ", ".join(f"B{b} x{v['steps']}: verify {v['verify_ms']:.2f} (median {v['verify_median_ms']:.2f}) "
                                   f"draft {v['draft_ms']:.2f}" for b, v in ds["per_block"].items())
                print(f"    steps ms: --no-draft {ps['step_ms']:.2f} (median {ps['step_median_ms']:.2f}); default {blocks}; "
                      f"outside {ds['outside_ms']:.2f} "
                      f"a step; {ds['shadow_probes']} shadow probes", file=sys.stderr, flush=True)
    per_prompt = {}
    for prompt in dict.fromkeys(r["prompt"] for r in rows):
        rs = [r for r in rows if r["prompt"] == prompt]
        per_prompt[prompt] = {"ratio_median": statistics.median(r["ratio"] for r in rs),
                              "default_tps_median": statistics.median(r["default_tps"] for r in rs),
                              "no_draft_tps_median": statistics.median(r["no_draft_tps"] for r in rs),
                              "same_tokens": all(r["same_tokens"] for r in rs)}
    ratios = [v["ratio_median"] for v in per_prompt.values()]
    summary = {"median_ratio": statistics.median(ratios),
               "geomean_ratio": math.exp(sum(math.log(x) for x in ratios) / len(ratios)),
               "lowest_ratio": min(ratios), "all_same_tokens": all(v["same_tokens"] for v in per_prompt.values())}
    result = {"command_args": extra, "default_args": args.default_args.split(), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "warmup": args.warmup,
              "per_prompt": per_prompt, "summary": summary, "runs": rows}
    print("| prompt | default tok/s | --no-draft tok/s | ratio |\n|---|---:|---:|---:|", file=sys.stderr)
    for prompt, v in per_prompt.items():
        print(f"| {prompt!r} | {v['default_tps_median']:.1f} | {v['no_draft_tps_median']:.1f} | {v['ratio_median']:.2f} |",
              file=sys.stderr)
    print(json.dumps(summary), file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
