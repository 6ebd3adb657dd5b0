"""What a plain step costs inside the speculative loop, against graphed plain decoding.

    # on the GPU machine (the pair bench_speculation_gpu.py writes, written here on first use)
    python benchmarks/bench_plain_step.py --checkpoint-dir /tmp/spec/oss20b --dtype float32 --out plain_step.json

    # anywhere, the same code paths in seconds (tiny pair, simulated link)
    python benchmarks/bench_plain_step.py --preset tiny --device cpu --link-gbps 2 \\
        --checkpoint-dir /tmp/spec-tiny --tokens 16 --prompts 1 --repeats 1 --out /tmp/plain_step.json

On the H200 the speculative loop's steady plain steps were measured 5-10 % slower than graphed
plain decoding's time per token (bench_speculation_gpu.py, column "plain step / plain arm"), which
alone keeps low acceptance below the 0.97x floor. This benchmark takes the difference apart. The
target is loaded once with ``--cache-fraction`` of its experts cached; per prompt and repeat,
every arm runs from a cold cache and cold costs, the order reversed every other repeat:

- ``plain``: ``generate(..., cuda_graphs=True)`` (eager on a CPU), its own decoder;
- ``decoder``: generate's loop (``decode`` then argmax) on the decoder the speculative runs share
  (``verify_decoder``: graphs captured for every block length), no feature capture;
- ``decoder-rows``: the same loop on a decoder with the trained block's fixed rows (batch-invariant
  verify, ``verify_decoder(..., batch_invariant=True)``: every step runs that many rows, as oracle
  mode's steps do in a 16-bit dtype): what fixed rows cost a plain step, without the speculative loop;
- ``loop``: the speculative loop at ``--block-size 1`` (every step a plain step through the verify
  path: feature capture, the loop's bookkeeping), no planner;
- ``auto@P``: the loop with the block planner in oracle mode at acceptance P (``--acceptance``):
  its steady plain steps, between the drafted ones. In a 16-bit dtype oracle mode runs every step
  with the trained block's fixed rows (an honest oracle, ``verify_decoder``), which the other arms
  do not: float32 compares like with like.

Per step (from each arm's step callback): the wall time since the previous step, the exposed
fetch time (the time the forward blocked on expert fetches, from the cache's counters) and the
experts missed. Per run, over its steady plain steps (a plain step after a plain step, the first
four left out): the median of each, and for the loop arms the loop's own timing of the same
steps (draft + verify sections: what bench_speculation_gpu.py calls the steady plain step).
The summary gives per arm the median of those and of the ratio to ``plain``'s wall time in the
same prompt and repeat, with its range. ``--profile`` adds cProfile's top functions of one
``plain`` and one ``loop`` run. One JSON object goes to --out, a table to stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import import_pdflash  # noqa: E402

import_pdflash()

import torch  # noqa: E402

from bench_speculation_gpu import PROMPTS, _log, ensure_checkpoint, write_result  # noqa: E402
from pdflash.machine import machine_info  # noqa: E402


class StepClock:
    """An ``on_step`` callback recording, per step, wall seconds since the previous step, exposed
    fetch seconds and experts missed (cache counters), whether it was a plain step, and the loop's
    own timing of the step (speculative steps only)."""

    def __init__(self, rt):
        self.stats = rt.cache.stats
        self.rows: list[dict] = []
        self.restart()

    def restart(self) -> None:
        self.t, self.exposed, self.misses = time.perf_counter(), self.stats.exposed_s, self.stats.misses

    def __call__(self, info=None) -> None:
        now = time.perf_counter()
        inner = getattr(info, "verify_seconds", None)
        self.rows.append({
            "wall": now - self.t,
            "exposed": self.stats.exposed_s - self.exposed,
            "misses": self.stats.misses - self.misses,
            "plain": getattr(info, "block_size", 1) == 1 and not getattr(info, "shadow_block", 0),
            "inner": None if inner is None else info.draft_seconds + inner,
        })
        self.restart()


def steady(rows: list[dict], key: str, skip: int = 4) -> float | None:
    """Median of ``key`` over the plain steps that followed a plain step, the first ``skip`` left out."""
    xs = [b[key] for a, b in zip(rows, rows[1:]) if a["plain"] and b["plain"] and b[key] is not None][skip:]
    return statistics.median(xs) if xs else None


def run_arm(rt, draft, arm: str, prompt: list[int], n: int, ref: list[int], graphs: bool) -> tuple[StepClock, dict]:
    """One run of ``arm`` from a cold cache and cold costs: its step clock and the planner's report."""
    from pdflash.draft.offloaded import speculative_on_runtime, verify_decoder
    from pdflash.offload.generate import generate
    from pdflash.offload.graphs import GraphedDecoder

    rt.reset_cache()
    rt.forget_costs()
    clock = StepClock(rt)
    extra: dict = {}
    if arm == "plain":
        generate(rt, prompt, max_new_tokens=n, eos_token_ids=[], cuda_graphs=graphs, on_step=clock)
        clock.rows = clock.rows[1:]  # the first token: the prefill
    elif arm in ("decoder", "decoder-rows"):
        rows = arm == "decoder-rows"
        if graphs or rows:
            dec = verify_decoder(rt, draft, len(prompt) + n, None, batch_invariant=rows, graphs=graphs,
                                 at=len(prompt), blocks=range(1, draft.config.block_size + 1))
        else:
            dec = GraphedDecoder(rt, len(prompt) + n, graphs=False)
        extra["rows"] = dec.rows  # every step's rows (fixed rows), or None
        dec.tap_layers = []
        with rt.decode_threads(), torch.inference_mode():
            tok = int(dec.prefill(prompt).argmax())
            clock.restart()
            for _ in range(n - 1):
                tok = int(dec.decode(tok).argmax())
                clock()
    else:
        if arm == "loop":
            kw = {"block_size": 1}
        else:
            kw = {"block_size": "auto", "acceptance": float(arm.split("@")[1]), "reference": ref}
        res = speculative_on_runtime(rt, draft, prompt, n, predictor="none", eos_token_ids=[], graphs=graphs,
                                     on_step=clock, **kw)
        if res.planner is not None:
            extra["planner"] = {k: res.planner[k] for k in ("block_histogram", "probes", "shadow_probes")}
    return clock, extra


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint-dir", type=Path, required=True, help="Target checkpoint (draft in DIR/draft); written if missing.")
    ap.add_argument("--preset", default="gpt-oss-20b", help="Shape of a checkpoint to write: gpt-oss-20b or tiny.")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--acceptance", default="0.0,0.3", help="Comma-separated oracle acceptance rates of the auto arms.")
    ap.add_argument("--cache-fraction", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--link-gbps", type=float, default=None, help="CPU only: simulated link.")
    ap.add_argument("--profile", action="store_true", help="Add cProfile's top functions of one plain and one loop run.")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be between 1 and {len(PROMPTS)}")
    if args.tokens < 8 or args.repeats < 1:
        ap.error("--tokens must be at least 8 and --repeats at least 1")
    try:
        acceptance = [float(p) for p in args.acceptance.split(",") if p.strip()]
    except ValueError:
        acceptance = [-1.0]  # not a number: refused below
    if not all(0.0 <= p <= 1.0 for p in acceptance):
        ap.error(f"--acceptance takes comma-separated rates in [0, 1], got {args.acceptance!r}")

    from pdflash.draft import load_draft
    from pdflash.draft.offloaded import oracle_reference, verify_decoder
    from pdflash.offload.generate import generate
    from pdflash.offload.runtime import OffloadedModel

    t_start = time.perf_counter()
    draft_preset = "tiny" if args.preset == "tiny" else "gpt-oss-20b-DFlash"
    make_s = ensure_checkpoint(args.checkpoint_dir, args.preset, draft_preset, 0)
    graphs = args.device.startswith("cuda")
    cfg = json.loads((args.checkpoint_dir / "config.json").read_text())
    total = int(cfg["num_hidden_layers"]) * int(cfg["num_local_experts"])
    slots = max(1, round(args.cache_fraction * total))
    from pdflash.draft.config import DFlashConfig

    trained = DFlashConfig.from_dir(args.checkpoint_dir / "draft").block_size
    arms = ["plain", "decoder", "decoder-rows", "loop"] + [f"auto@{p}" for p in acceptance]
    runs: list[dict] = []
    profiles: dict[str, str] = {}
    with OffloadedModel.load(args.checkpoint_dir, device=args.device, dtype=args.dtype, expert_cache_experts=slots,
                             block_tokens=trained, link_gbps=args.link_gbps) as rt:
        draft = load_draft(args.checkpoint_dir / "draft", rt.model)
        for pi, text in enumerate(PROMPTS[: args.prompts]):
            prompt = rt.tokenizer.encode(text)
            dec = verify_decoder(rt, draft, len(prompt) + args.tokens, 1.0, graphs=graphs, at=len(prompt),
                                 blocks=range(1, trained + 1))
            rt.reset_cache()
            ref = oracle_reference(rt, prompt, args.tokens, trained, decoder=dec)  # untimed
            generate(rt, prompt, max_new_tokens=8, eos_token_ids=[], cuda_graphs=graphs)  # warm-up
            for rep in range(args.repeats):
                for arm in (arms if rep % 2 == 0 else arms[::-1]):
                    clock, extra = run_arm(rt, draft, arm, prompt, args.tokens, ref, graphs)
                    ms = {k: (None if (v := steady(clock.rows, k)) is None else 1e3 * v) for k in ("wall", "exposed", "inner")}
                    row = {"prompt": pi, "repeat": rep, "arm": arm, "steady_wall_ms": ms["wall"],
                           "steady_exposed_ms": ms["exposed"], "steady_loop_ms": ms["inner"],
                           "steady_misses": steady(clock.rows, "misses"), "hit_rate": rt.stats()["cache"]["hit_rate"],
                           **extra}
                    runs.append(row)
                    _log(f"prompt {pi} repeat {rep} {arm}: steady step {ms['wall'] or 0:.2f} ms, "
                         f"exposed fetch {ms['exposed'] or 0:.2f} ms")
        if args.profile:
            prompt = rt.tokenizer.encode(PROMPTS[0])
            for arm in ("plain", "loop"):
                prof = cProfile.Profile()
                prof.enable()
                run_arm(rt, draft, arm, prompt, args.tokens, [], graphs)
                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
                profiles[arm] = text.getvalue()

    summary = {}
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm and r["steady_wall_ms"] is not None]
        ratios = []
        for r in rs:
            base = next((q for q in runs if q["arm"] == "plain" and q["prompt"] == r["prompt"]
                         and q["repeat"] == r["repeat"] and q["steady_wall_ms"]), None)
            if base is not None:
                ratios.append(r["steady_wall_ms"] / base["steady_wall_ms"])

        def med(key):
            xs = [r[key] for r in rs if r.get(key) is not None]
            return statistics.median(xs) if xs else None

        summary[arm] = {"steady_wall_ms": med("steady_wall_ms"), "steady_exposed_ms": med("steady_exposed_ms"),
                        "steady_loop_ms": med("steady_loop_ms"), "steady_misses": med("steady_misses"),
                        "vs_plain": statistics.median(ratios) if ratios else None,
                        "vs_plain_range": [min(ratios), max(ratios)] if ratios else None, "runs": len(rs)}

    def f(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    lines = ["| arm | steady step ms | vs plain (median, range) | exposed fetch ms | loop's own ms | misses / step |",
             "|---|---:|---:|---:|---:|---:|"]
    for arm, s in summary.items():
        rng = s["vs_plain_range"]
        lines.append(f"| {arm} | {f(s['steady_wall_ms'])} | {f(s['vs_plain'], '.3f')}x "
                     f"({'-' if rng is None else f'{rng[0]:.3f}-{rng[1]:.3f}'}) | {f(s['steady_exposed_ms'])} "
                     f"| {f(s['steady_loop_ms'])} | {f(s['steady_misses'], '.1f')} |")
    result = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine_info(args.device),
        "make_checkpoint_seconds": make_s,
        "wall_seconds": time.perf_counter() - t_start,
        "summary": summary,
        "runs": runs,
        "profiles": profiles,
        "markdown": "\n".join(lines),
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
