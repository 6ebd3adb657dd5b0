"""Oracle mode with and without batch-invariant verify: does acceptance match P's expectation?

    python benchmarks/bench_batch_invariant.py --model DIR --draft DIR [--device cuda] \\
        [--acceptance 0.9,0.7] [--blocks auto,4] [--prompts 3] [--max-new-tokens 48] [--out res.json]

For every prompt, P and block setting, two speculative runs in oracle-acceptance mode (in random
order, each from an empty expert cache and the cost model's priors): every verify pass with the
draft's trained block length of rows (``batch_invariant=True``, draft/offloaded.py verify_decoder),
and each block with its own length (``False``). Each run computes its own reference through its
own verify path (untimed). Reported per run: the oracle's divergences and refresh forwards, the
acceptance length against what the draws promise for the block lengths used (1 + P + ... +
P^(B-1) per step, averaged over the steps), and tokens/s; per setting the medians and the
fixed-rows / per-block tokens/s ratio (the price of the padding rows).

Divergences appear where a 16-bit block and a step of another length round a near-tied argmax
apart; a checkpoint shaped like the real model (wide hidden size, many vocabulary rows) shows
them, a tiny one rarely does (``pdflash make-synthetic DIR --preset gpt-oss-20b --mxfp4 --layers 2
--experts 8 --vocab 8192 --draft-preset tiny`` makes one small enough for a CPU).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import import_pdflash  # noqa: E402

import_pdflash()

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import os\nimport sys\n", "class Parser:",
           "Once upon a time", "SELECT name FROM users WHERE"]


def expected_acceptance(p: float, histogram: dict) -> float | None:
    """Acceptance length the draws promise: per step of block B, 1 + p + ... + p^(B-1)."""
    steps = sum(histogram.values())
    if not steps:
        return None
    return sum(n * sum(p ** k for k in range(int(b))) for b, n in histogram.items()) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="target checkpoint directory")
    ap.add_argument("--draft", type=Path, required=True, help="DFlash draft checkpoint directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype (the comparison matters in 16-bit ones)")
    ap.add_argument("--cache-fraction", type=float, default=0.25, help="expert cache size as a fraction of all experts (at least what one layer's block needs)")
    ap.add_argument("--acceptance", default="0.9,0.7", help="oracle P values, comma-separated")
    ap.add_argument("--blocks", default="auto,4", help="block settings: auto and / or fixed lengths, comma-separated")
    ap.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} built-in prompts")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the runs and summary as JSON here")
    args = ap.parse_args(argv)
    try:
        ps = [float(x) for x in args.acceptance.split(",")]
        blocks = [b if b == "auto" else int(b) for b in args.blocks.split(",")]
    except ValueError:
        print("error: --acceptance takes numbers and --blocks 'auto' or integers, comma-separated", file=sys.stderr)
        return 2
    if not all(0 <= p <= 1 for p in ps) or any(b != "auto" and b < 1 for b in blocks) \
            or not 1 <= args.prompts <= len(PROMPTS) or args.max_new_tokens < 2 or not 0 < args.cache_fraction <= 1:
        print(f"error: P in [0, 1], blocks >= 1, --prompts 1..{len(PROMPTS)}, --max-new-tokens >= 2, "
              "--cache-fraction in (0, 1]", file=sys.stderr)
        return 2

    from pdflash import PdflashError
    from pdflash.draft.offloaded import load_runtime_draft, speculative_on_runtime
    from pdflash.draft.config import DFlashConfig
    from pdflash.offload.runtime import OffloadedModel

    try:
        trained = DFlashConfig.from_dir(args.draft).block_size
        if any(b != "auto" and b > trained for b in blocks):
            raise PdflashError(f"the draft is trained for blocks of up to {trained}")
        cfg = json.loads((args.model / "config.json").read_text())
        total = int(cfg["num_hidden_layers"]) * int(cfg["num_local_experts"])
        floor = min(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]) * trained)  # one layer's block
        rt = OffloadedModel.load(args.model, device=args.device, dtype=args.dtype, block_tokens=trained,
                                 expert_cache_experts=max(floor, round(args.cache_fraction * total)))
    except (PdflashError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    runs = []
    with rt:
        draft = load_runtime_draft(rt, args.draft)
        prompts = [rt.tokenizer.encode(t) for t in PROMPTS[: args.prompts]]
        for pi, prompt in enumerate(prompts):
            for p in ps:
                for block in blocks:
                    order = [True, False]
                    random.Random(args.seed * 1000 + pi * 10 + ps.index(p)).shuffle(order)
                    for fixed in order:
                        rt.reset_cache()
                        rt.forget_costs()
                        res = speculative_on_runtime(rt, draft, prompt, args.max_new_tokens, block_size=block,
                                                     acceptance=p, predictor="none", eos_token_ids=[], seed=args.seed + pi,
                                                     batch_invariant=fixed)
                        hist = res.stats.block_histogram()
                        run = {"prompt": pi, "acceptance": p, "block": block, "fixed_rows": res.verify_rows,
                               "tokens_per_second": res.tokens_per_second, "block_histogram": hist,
                               "acceptance_length": res.stats.acceptance_length,
                               "expected_acceptance_length": expected_acceptance(p, hist),
                               "divergences": res.oracle["oracle_divergences"], "refreshes": res.oracle["oracle_refreshes"],
                               "refresh_seconds": res.oracle["oracle_refresh_seconds"]}
                        runs.append(run)
                        print(f"prompt {pi} P={p} block {block} fixed rows {res.verify_rows}: "
                              f"{run['tokens_per_second'] or 0:.2f} tok/s, accept {run['acceptance_length']:.2f} "
                              f"(draws promise {run['expected_acceptance_length'] or 0:.2f}), "
                              f"divergences {run['divergences']}, refreshes {run['refreshes']}", file=sys.stderr, flush=True)
    summary = {}
    for p in ps:
        for block in blocks:
            key = f"P={p} block={block}"
            summary[key] = {}
            for fixed in (True, False):
                mine = [r for r in runs if r["acceptance"] == p and r["block"] == block and bool(r["fixed_rows"]) == fixed]
                summary[key]["fixed_rows" if fixed else "per_block"] = {
                    "divergences": sum(r["divergences"] for r in mine),
                    "refreshes": sum(r["refreshes"] for r in mine),
                    "acceptance_length": statistics.median(r["acceptance_length"] for r in mine),
                    "expected_acceptance_length": statistics.median(r["expected_acceptance_length"] or 0 for r in mine),
                    "tokens_per_second": statistics.median(r["tokens_per_second"] or 0 for r in mine),
                }
            tps = {(r["prompt"], bool(r["fixed_rows"])): r["tokens_per_second"] for r in runs
                   if r["acceptance"] == p and r["block"] == block}
            ratios = [tps[(pi, True)] / tps[(pi, False)] for pi in range(len(prompts)) if tps.get((pi, True)) and tps.get((pi, False))]
            summary[key]["fixed_vs_per_block_tps"] = statistics.median(ratios) if ratios else None
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                        "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
