"""Does speculation pay on an offloaded target? Graphed plain decoding against speculative
decoding with the block planner (``--block-size auto``) and fixed block lengths, in oracle mode at
several acceptance rates, for bf16 and float32 compute, in one process.

    # on the GPU machine: writes the gpt-oss-20b-shaped MXFP4 pair on first use, then measures
    python benchmarks/bench_speculation_gpu.py --checkpoint-dir /tmp/pdflash-spec/oss20b --out spec_gpu.json

    # anywhere, the same code paths in seconds (tiny pair, simulated 2 GB/s link)
    python benchmarks/bench_speculation_gpu.py --preset tiny --device cpu --link-gbps 2 \\
        --checkpoint-dir /tmp/spec-tiny --tokens 16 --prompts 1 --out /tmp/spec_tiny.json

Per compute dtype the target is loaded once with an expert cache of ``--cache-fraction`` of all
experts (default 25 %). Per prompt: the oracle's reference continuation for each block length
used (from the verify path: ``pdflash.draft.offloaded.oracle_reference``), then every arm from a
cold cache (``reset_cache``) and a cold cost model (``forget_costs``, as a fresh ``pdflash
generate`` process starts), in an order shuffled per prompt with a fixed seed:

- ``plain``: graphed plain decoding (``generate(..., cuda_graphs=True)``; eager on CPU);
- ``auto@P``: speculative decoding, block planner, oracle acceptance P, route-ahead by ``--predictor`` (default: generate's, none);
- ``auto-real@P`` (with ``--probes shadow,real`` or ``real``): the planner with every probe a verified block, no shadow probes;
- ``auto-noretreat@P`` (with ``--no-retreat-arm``): the planner without its retreat rule (draft/planner.py);
- ``auto-noover@P`` (with ``--no-overdraft-arm``): the planner drafting only the blocks it verifies (overdraft 1);
- ``auto-m105@P`` (with ``--margin-arm``): the planner with a 5 % margin between two speculative lengths;
- ``auto-notrial@P`` (with ``--no-trial-arm``): the planner without trials (draft/planner.py);
- ``auto-prev@P`` (with ``--previous-arm``): the planner before four changes, for an A/B in one run: route-ahead
  fetch prediction only, no trials from plain decoding, probes every 8 steps after a fully accepted one, long-run
  acceptance weight 4;
- ``B<n>@P``: the same with a fixed block length n.

Verify blocks replay CUDA graphs per block length (on CUDA). Per run: tokens/s after the first
token, acceptance length, block lengths chosen, bytes over the link per committed token (decode
phase; for ``plain`` per token after the first, the whole run's in ``run_bytes_per_token``), oracle
divergences / refreshes (0 expected), the planner's mean predicted and measured step time and
probes, the drafting share (:func:`drafting_share`: what the steps that ran the draft cost beyond
plain decoding, as a share of the run), the run's steady plain step (:func:`steady_plain_seconds`;
the summary divides it by the plain arm's time per token: what the speculative loop's own plain
steps cost over plain decoding), and whether the tokens equal plain decoding's. The summary gives per dtype and arm the median tokens/s
and the median same-prompt ratio to ``plain``, and checks the targets of auto against plain:
P = 0.9 >= 1.6x, P = 0.7 >= 1.2x, P = 0.3 >= 0.97x. One JSON object goes to --out, a markdown
table to stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from pdflash.draft.offloaded import DEFAULT_PREDICTOR
from pdflash.machine import machine_info
from pdflash.offload.cache import DEFAULT_EVICTION, EVICTION_POLICIES
from pdflash.offload.cpu_compute import GUARD_ARMS

TARGETS = {0.9: 1.6, 0.7: 1.2, 0.3: 0.97}  # auto / plain, same run (issue: speculation that pays)
PROMPTS = (
    "The expert cache keeps the most useful experts on the device and",
    "def fibonacci(n):\n    ",
    "Write a short story about a lighthouse keeper who",
    "import numpy as np\n\n",  # prompts 4-6: more of the oracle's seeded draws per call (--prompts 6)
    "The capital of France is",
    "Summarize the following paragraph in one sentence:",
)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_checkpoint(path: Path, preset: str, draft_preset: str, seed: int) -> float:
    """Write the synthetic MXFP4 pair unless it is there; returns the seconds spent."""
    if (path / "config.json").is_file() and (path / "draft" / "config.json").is_file():
        return 0.0
    from pdflash.draft import write_synthetic_draft
    from pdflash.offload.config import ModelPreset
    from pdflash.offload.synthetic import write_checkpoint

    t0 = time.perf_counter()
    _log(f"writing the {preset} MXFP4 checkpoint and its {draft_preset} draft to {path}")
    write_checkpoint(path, ModelPreset.from_name(preset), mxfp4=True, seed=seed, dtype="bfloat16")
    write_synthetic_draft(path / "draft", draft_preset, target_dir=path, seed=seed, dtype="bfloat16")
    return time.perf_counter() - t0


def write_result(out: Path, result: dict) -> None:
    """The result as JSON to ``out``, its markdown table and the wall time to stderr."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _log(result["markdown"])
    _log(f"wrote {out} in {result['wall_seconds']:.0f} s")


def _encode(rt, n: int) -> list[list[int]]:
    tok = rt.tokenizer
    return [tok.encode(t) for t in PROMPTS[:n]]


def _moved(rt) -> float:
    return float(sum(lv["bytes"] for lv in rt.scheduler.stats()["levels"]))


# The planner arms besides "auto": BlockPlanner keyword arguments that switch one rule off.
ARM_OPTIONS = {
    "auto-real": {"shadow_probes": False},  # every probe a verified block
    "auto-noretreat": {"retreat": None},  # no retreat rule
    "auto-noover": {"overdraft": 1},  # draft only the blocks it verifies
    "auto-m105": {"spec_margin": 1.05},  # a 5 % margin between two speculative lengths (default 15 %)
    "auto-notrial": {"trial_margin": None},  # no trials of a length priced a little ahead
    # the planner before its fetch prediction by the smaller recent error, its trials from plain decoding,
    # its quick probe after a fully accepted one and its long-run acceptance weight of 2 (all 2026-12-05, late)
    "auto-prev": {"fetch_prediction": "route", "trial_from_plain": False, "probe_after_accept": None,
                  "long_run_weight": 4.0},
}


def planner_options(args, kind: str = "auto") -> dict | None:
    """BlockPlanner keyword arguments of --home-block / --first-block and of the arm ``kind``
    (:data:`ARM_OPTIONS`) (None: the defaults)."""
    opts = dict(ARM_OPTIONS.get(kind, {}))
    opts.update(getattr(args, "variants", {}).get(kind, {}))
    if args.home_block:
        opts["home_block"] = args.home_block
    if args.first_block == "home":
        opts["first_by_cost"] = False
    if args.trace:
        opts["trace"] = True
    return opts or None


def _seconds(step) -> float:
    return step.draft_seconds + step.verify_seconds


def _plain(step) -> bool:
    return step.block_size == 1 and not step.shadow_block


def steady_plain_seconds(steps, least: int = 8) -> float | None:
    """The median steady plain step of a speculative run (one that ran no draft and followed such
    a step), None for fewer than ``least`` of them: what the loop's own plain steps cost, against
    the plain arm's time per token."""
    steady = [_seconds(b) for a, b in zip(steps, steps[1:]) if _plain(a) and _plain(b)]
    return statistics.median(steady) if len(steady) >= least else None


def drafting_share(steps, least: int = 8) -> float | None:
    """What the steps that ran the draft (verified blocks and shadow probes) cost beyond plain
    decoding, as a share of the run's step time: each such step's time less its committed tokens
    at the run's median steady plain step (:func:`steady_plain_seconds`). Negative: drafting
    gained. It leaves out the run-to-run noise of the plain steps themselves, which a ratio of two
    runs keeps; None where the run has fewer than ``least`` steady plain steps."""
    per_token = steady_plain_seconds(steps, least)
    total = sum(_seconds(s) for s in steps)
    if per_token is None or total <= 0:
        return None
    return sum(_seconds(s) - len(s.committed) * per_token for s in steps if not _plain(s)) / total


def run_dtype(args, dtype: str, trained: int) -> list[dict]:
    from pdflash.draft import load_draft
    from pdflash.draft.offloaded import draft_pass_kind, oracle_reference, speculative_on_runtime, verify_decoder
    from pdflash.offload.generate import generate
    from pdflash.offload.runtime import OffloadedModel

    graphs = args.device.startswith("cuda")
    blocks = sorted({b for b in args.blocks if 1 < b <= trained})
    cfg = json.loads((args.checkpoint_dir / "config.json").read_text())
    total = int(cfg["num_hidden_layers"]) * int(cfg["num_local_experts"])
    slots = max(1, round(args.cache_fraction * total))
    t0 = time.perf_counter()
    rt = OffloadedModel.load(args.checkpoint_dir, device=args.device, dtype=dtype, expert_cache_experts=slots,
                             block_tokens=trained, link_gbps=args.link_gbps, cpu_experts=args.cpu_experts,
                             eviction=args.eviction, progress=False)
    _log(f"[{dtype}] loaded in {time.perf_counter() - t0:.1f} s; cache {rt.cache.capacity}/{total} experts, {args.eviction} eviction")
    rows: list[dict] = []
    try:
        draft = load_draft(args.checkpoint_dir / "draft", rt.model)
        prompts = _encode(rt, args.prompts)
        n = args.tokens
        autos = [{"shadow": "auto", "real": "auto-real"}[k] for k in args.probes]
        autos += ["auto-noretreat"] if args.no_retreat_arm else []
        autos += ["auto-noover"] if args.no_overdraft_arm else []
        autos += ["auto-m105"] if args.margin_arm else []
        autos += ["auto-notrial"] if args.no_trial_arm else []
        autos += ["auto-prev"] if args.previous_arm else []
        autos += list(args.variants)
        arms = ["plain"] + [f"{kind}@{p}" for p in args.acceptance for kind in autos + [f"B{b}" for b in blocks]]
        guard = rt.placer.guard if rt.placer is not None else None
        if args.guard_arm:
            if guard is None:
                raise SystemExit("Error: --guard-arm needs --cpu-experts auto on a runtime with a hybrid guard")
            arms.append("plain-fetch")  # plain decoding with every miss fetched: the fetch-only reference
        for pi, prompt in enumerate(prompts):
            refs: dict[int, list[int]] = {}
            # The verify path of the runs below: graphed on CUDA, in a 16-bit dtype with fixed rows where
            # blocks round apart from single steps (oracle mode: draft/offloaded.py verify_decoder); with
            # fixed rows, or where the check found them alike, one reference serves every block length.
            dec = verify_decoder(rt, draft, len(prompt) + n, 1.0, batch_invariant=args.batch_invariant, graphs=graphs,
                                 at=len(prompt), blocks=range(1, trained + 1), probe=prompt)
            one = dec is not None and (dec.rows is not None or dec.rows_check == "agree")
            for b in sorted(set(blocks) | {trained}, reverse=True):  # untimed: the reference of each block length
                if one and refs:
                    refs[b] = refs[trained]
                    continue
                rt.reset_cache()
                refs[b] = oracle_reference(rt, prompt, n, b, decoder=dec)
            rt.reset_cache()  # warm-up of the plain path (allocations, kernels)
            generate(rt, prompt, max_new_tokens=min(n, 8), eos_token_ids=[], cuda_graphs=graphs)
            order = arms[:]
            random.Random(args.seed * 1000 + pi).shuffle(order)
            plain_tokens = None
            results = {}
            for arm in order:
                rt.reset_cache()
                rt.forget_costs()
                if arm == "plain-fetch":
                    guard.pin("off", longer=True)  # fetch-only, the prompt's prefill too
                elif args.guard_arm not in (None, "guard"):
                    guard.pin(args.guard_arm)
                elif args.guard_arm == "guard":
                    guard.unpin()  # every arm's own check, from its first step
                if arm in ("plain", "plain-fetch"):
                    first: list[float] = []  # link bytes when the first token is out: the decode phase starts
                    res = generate(rt, prompt, max_new_tokens=n, eos_token_ids=[], cuda_graphs=graphs,
                                   on_step=lambda info: first.append(_moved(rt)) if info.index == 0 else None)
                    st = rt.stats()
                    decoded = len(res.token_ids) - 1
                    row = {"tokens_per_second": res.tokens_per_second, "token_ids": res.token_ids,
                           # the decode phase's bytes per token, as the speculative rows' per committed token
                           "bytes_per_token": (_moved(rt) - first[0]) / decoded if first and decoded else None,
                           "run_bytes_per_token": st["bytes_moved"] / len(res.token_ids), "hit_rate": st["cache"]["hit_rate"],
                           "cpu_experts_per_token": st["experts_per_token"]["cpu"]}
                    if arm == "plain":
                        plain_tokens = res.token_ids
                else:
                    kind, p = arm.split("@")
                    block = "auto" if kind.startswith("auto") else int(kind[1:])
                    ref = refs[trained if block == "auto" else block]
                    steps: list = []
                    res = speculative_on_runtime(rt, draft, prompt, n, block_size=block, acceptance=float(p),
                                                 reference=ref, predictor=args.predictor, seed=args.seed + pi,
                                                 batch_invariant=args.batch_invariant,
                                                 planner_options=planner_options(args, kind),
                                                 eos_token_ids=[], graphs=graphs, on_step=steps.append)
                    d = res.to_dict()
                    st = rt.stats()
                    row = {k: d.get(k) for k in ("tokens_per_second", "token_ids", "acceptance_length", "block_histogram",
                                                  "bytes_per_committed_token", "oracle_divergences", "oracle_refreshes",
                                                  "acceptance_per_position", "draft_ms", "verify_ms", "verify_steps",
                                                  "verify_rows", "verify_rows_check")}
                    row["hit_rate"] = st["cache"]["hit_rate"]
                    row["cpu_experts_per_token"] = st["experts_per_token"]["cpu"]
                    row["guard"] = (st.get("cpu_experts") or {}).get("guard")  # the hybrid guard's arm and medians
                    row["same_tokens_as_reference"] = res.token_ids == ref
                    row["drafting_share"] = drafting_share(steps)
                    steady = steady_plain_seconds(steps)
                    row["steady_plain_ms"] = None if steady is None else 1e3 * steady
                    if res.planner is not None:
                        row["planner"] = {k: res.planner[k] for k in ("predicted_step_ms", "measured_step_ms",
                                                                       "step_time_abs_error_ms", "probes", "shadow_probes",
                                                                       "retreats", "trials", "trials_kept",
                                                                       "overdrafted_blocks",
                                                                       "acceptance_conditional", "block_histogram",
                                                                       "plain_step_ms", "realized_vs_plain", "candidates")}
                        if "trace" in res.planner:
                            row["planner"]["trace"] = res.planner["trace"]
                        row["cost"] = res.planner["cost"]
                    row["draft_pass"] = draft_pass_kind(draft)
                results[arm] = row
                _log(f"[{dtype}] prompt {pi} {arm}: {row['tokens_per_second'] or 0:.2f} tok/s"
                     + (f", accept {row['acceptance_length']:.2f}, blocks {row['block_histogram']}, "
                        f"repairs {row['oracle_refreshes']}, rows {row['verify_rows']} ({row['verify_rows_check']})"
                        if not arm.startswith("plain") else ""))
            for arm, row in results.items():
                row["same_tokens_as_plain"] = row.pop("token_ids") == plain_tokens
                rows.append({"dtype": dtype, "prompt": pi, "arm": arm, **row})
    finally:
        rt.close()
    return rows


def summarise(rows: list[dict]) -> dict:
    out: dict = {}
    for dtype in sorted({r["dtype"] for r in rows}):
        mine = [r for r in rows if r["dtype"] == dtype]
        plain = {r["prompt"]: r["tokens_per_second"] for r in mine if r["arm"] == "plain"}
        fetch = {r["prompt"]: r["tokens_per_second"] for r in mine if r["arm"] == "plain-fetch"}
        per_arm = {}
        for arm in dict.fromkeys(r["arm"] for r in mine):
            rs = [r for r in mine if r["arm"] == arm]
            tps = [r["tokens_per_second"] for r in rs if r["tokens_per_second"]]
            ratios = [r["tokens_per_second"] / plain[r["prompt"]] for r in rs
                      if r["tokens_per_second"] and plain.get(r["prompt"])]
            hist: dict[str, int] = {}
            for r in rs:
                for b, c in (r.get("block_histogram") or {}).items():
                    hist[b] = hist.get(b, 0) + c
            s = {
                "tokens_per_second": statistics.median(tps) if tps else None,
                "vs_plain": statistics.median(ratios) if ratios else None,
                "vs_plain_range": [min(ratios), max(ratios)] if ratios else None,
                "runs": len(rs),
            }
            if fetch:  # --guard-arm: every arm also against fetch-only plain decoding
                vf = [r["tokens_per_second"] / fetch[r["prompt"]] for r in rs
                      if r["tokens_per_second"] and fetch.get(r["prompt"])]
                s["vs_plain_fetch"] = statistics.median(vf) if vf else None
                s["vs_plain_fetch_range"] = [min(vf), max(vf)] if vf else None
            if not arm.startswith("plain"):
                acc = [r["acceptance_length"] for r in rs if r.get("acceptance_length")]
                bpt = [r["bytes_per_committed_token"] for r in rs if r.get("bytes_per_committed_token") is not None]
                s.update({
                    "acceptance_length": statistics.median(acc) if acc else None,
                    "block_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
                    "bytes_per_committed_token": statistics.median(bpt) if bpt else None,
                    "oracle_refreshes": sum(r.get("oracle_refreshes") or 0 for r in rs),
                    "oracle_divergences": sum(r.get("oracle_divergences") or 0 for r in rs),
                    "drafting_share": statistics.median(ds) if (ds := [r["drafting_share"] for r in rs
                                                                      if r.get("drafting_share") is not None]) else None,
                    # the loop's steady plain step over the plain arm's time per token, same prompt
                    "plain_step_vs_plain_arm": statistics.median(ps) if (ps := [
                        r["steady_plain_ms"] * plain[r["prompt"]] / 1e3 for r in rs
                        if r.get("steady_plain_ms") and plain.get(r["prompt"])]) else None,
                })
            else:
                bpt = [r["bytes_per_token"] for r in rs if r["bytes_per_token"] is not None]
                s["bytes_per_token"] = statistics.median(bpt) if bpt else None
            per_arm[arm] = s
        checks = {}
        for p, want in TARGETS.items():
            got = per_arm.get(f"auto@{p}", {}).get("vs_plain")
            if got is not None:
                checks[f"auto@{p}"] = {"target": want, "vs_plain": got, "met": got >= want}
        out[dtype] = {"arms": per_arm, "targets": checks}
    return out


def markdown(summary: dict) -> str:
    def f(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    lines = []
    for dtype, s in summary.items():
        lines += [f"**{dtype}**", "", "| arm | tok/s | vs plain (median, range) | accept len | blocks (B:steps) | MB / committed token | repairs | drafting share | plain step / plain arm |",
                  "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
        for arm, a in s["arms"].items():
            rng = a["vs_plain_range"]
            mb = a.get("bytes_per_committed_token", a.get("bytes_per_token"))
            lines.append(
                f"| {arm} | {f(a['tokens_per_second'])} | {f(a['vs_plain'])}x"
                f" ({'-' if rng is None else f'{rng[0]:.2f}-{rng[1]:.2f}'})"
                + (f"; {f(a['vs_plain_fetch'])}x plain-fetch" if "vs_plain_fetch" in a else "")
                + f" | {f(a.get('acceptance_length'))}"
                f" | {' '.join(f'{b}:{c}' for b, c in (a.get('block_histogram') or {}).items()) or '-'}"
                f" | {f(None if mb is None else mb / 1e6)} | {a.get('oracle_refreshes', '-')}"
                f" | {f(a.get('drafting_share'), '+.1%')} | {f(a.get('plain_step_vs_plain_arm'), '.3f')} |")
        for name, c in s["targets"].items():
            lines.append(f"\ntarget {name}: {c['vs_plain']:.2f}x against >= {c['target']}x: {'met' if c['met'] else 'NOT met'}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint-dir", type=Path, required=True, help="Target checkpoint (draft in DIR/draft); written if missing.")
    ap.add_argument("--preset", default="gpt-oss-20b", help="Shape of a checkpoint to write: gpt-oss-20b or tiny.")
    ap.add_argument("--draft-preset", default=None, help="Draft shape (default: gpt-oss-20b-DFlash, tiny for --preset tiny).")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="Comma-separated compute dtypes, one load each.")
    ap.add_argument("--acceptance", default="0.9,0.7,0.3", help="Comma-separated oracle acceptance rates P.")
    ap.add_argument("--blocks", default="2,4,8", help="Fixed block lengths measured next to auto (capped at the draft's).")
    ap.add_argument("--cache-fraction", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=48, help="Tokens generated per run.")
    ap.add_argument("--prompts", type=int, default=2, help=f"How many of the {len(PROMPTS)} built-in prompts to run.")
    ap.add_argument("--link-gbps", type=float, default=None, help="CPU only: simulated link.")
    ap.add_argument("--cpu-experts", choices=("off", "auto", "all"), default="off",
                    help="Hybrid expert execution for every arm, plain included (generate's --cpu-experts; default off).")
    ap.add_argument("--guard-arm", choices=(*GUARD_ARMS, "guard"), default=None,
                    help="With --cpu-experts auto: pin the hybrid guard's placement for every arm (off: fetch every "
                         "miss; model: the cost model's split; host: every miss not in flight on the CPU; all: every "
                         "routed expert on the CPU; guard: no pin, each arm starts a fresh check), and add an arm "
                         "plain-fetch (plain decoding, fetch-only) that every arm is also compared with (vs_plain_fetch).")
    ap.add_argument("--eviction", choices=EVICTION_POLICIES, default=DEFAULT_EVICTION, help="The expert cache's eviction policy.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--predictor", default=DEFAULT_PREDICTOR,
                    help=f"Route-ahead predictor of the speculative arms (default: generate's, {DEFAULT_PREDICTOR}).")
    ap.add_argument("--batch-invariant", choices=["auto", "on", "off"], default="auto",
                    help="Fixed rows for every verify pass (draft/offloaded.py verify_decoder); auto: in bf16 / fp16.")
    ap.add_argument("--home-block", type=int, default=None,
                    help="The planner's home block: the longest first drafted block (default: half the trained block).")
    ap.add_argument("--first-block", choices=["cost", "home"], default="cost",
                    help="How the planner picks its first drafted block: by predicted cost (default) or the home block itself.")
    ap.add_argument("--probes", default="shadow",
                    help="Comma-separated kinds of the planner's probes while plain decoding leads, one auto arm "
                         "each: shadow (arm auto: drafted and checked against the committed tokens, the default), "
                         "real (arm auto-real: drafted and verified as a block).")
    ap.add_argument("--trace", action="store_true",
                    help="Keep the planner's per-step trace in its rows (block, prediction against measurement, predicted "
                         "and missed experts, every length's predicted rate).")
    ap.add_argument("--no-trial-arm", action="store_true",
                    help="Add an arm auto-notrial: the planner without trials of a length priced a little ahead.")
    ap.add_argument("--previous-arm", action="store_true",
                    help="Add an arm auto-prev: the planner with the route-ahead fetch prediction only, no trials from "
                         "plain decoding, no quick probe after a fully accepted one, long-run acceptance weight 4.")
    ap.add_argument("--margin-arm", action="store_true",
                    help="Add an arm auto-m105: the planner with a 5 %% margin between two speculative lengths.")
    ap.add_argument("--no-overdraft-arm", action="store_true",
                    help="Add an arm auto-noover: the planner drafting only the blocks it verifies (overdraft 1).")
    ap.add_argument("--no-retreat-arm", action="store_true",
                    help="Add an arm auto-noretreat: the planner (shadow probes) without its retreat rule (draft/planner.py).")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="Add an arm auto-NAME: the planner with these BlockPlanner keyword arguments, e.g. "
                         "'home8={\"first_by_cost\": false, \"home_block\": 8}' (repeatable).")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.variants = {}
    from pdflash.draft.planner import parse_variant

    for spec in args.variant:
        try:
            name, kw = parse_variant(spec)
        except ValueError as exc:
            ap.error(f"--variant {exc}")
        if "@" in name:
            ap.error(f"--variant {name}: an arm name without '@'")
        args.variants[f"auto-{name}"] = kw
    if args.guard_arm and args.cpu_experts != "auto":
        ap.error("--guard-arm needs --cpu-experts auto")
    args.batch_invariant = {"auto": None, "on": True, "off": False}[args.batch_invariant]
    args.acceptance = [float(p) for p in args.acceptance.split(",") if p.strip()]
    args.blocks = [int(b) for b in args.blocks.split(",") if b.strip()]
    args.probes = list(dict.fromkeys(k.strip() for k in args.probes.split(",") if k.strip()))
    if not args.probes or not set(args.probes) <= {"shadow", "real"}:
        ap.error("--probes takes shadow, real or shadow,real")
    draft_preset = args.draft_preset or ("tiny" if args.preset == "tiny" else "gpt-oss-20b-DFlash")
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be between 1 and {len(PROMPTS)}")
    t_start = time.perf_counter()
    make_s = ensure_checkpoint(args.checkpoint_dir, args.preset, draft_preset, args.seed)
    from pdflash.draft.config import DFlashConfig

    trained = DFlashConfig.from_dir(args.checkpoint_dir / "draft").block_size
    rows = []
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        rows += run_dtype(args, dtype, trained)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    summary = summarise(rows)
    result = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "draft_preset": draft_preset, "trained_block_size": trained},
        "machine": machine_info(args.device),
        "make_checkpoint_seconds": make_s,
        "wall_seconds": time.perf_counter() - t_start,
        "summary": summary,
        "runs": rows,
        "markdown": markdown(summary),
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
