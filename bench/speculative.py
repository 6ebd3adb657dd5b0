"""Benchmark: speculative decoding with route-ahead against plain decoding on the offloaded runtime.

    # on the GPU machine (H200, PCIe Gen5): full-size synthetic pair, 25 % expert cache, P = 0.7
    pdflash make-synthetic /data/oss20b --preset gpt-oss-20b --mxfp4 --draft-preset gpt-oss-20b-DFlash
    python -m pdflash.bench.speculative --model /data/oss20b --draft /data/oss20b/draft --device cuda \\
        --cache-fraction 0.25 --acceptance 0.7 --out spec.json

    # anywhere (CPU, tiny pair written to a temporary directory, simulated 2 GB/s link)
    python -m pdflash.bench.speculative --synthetic tiny --device cpu --link-gbps 2 --max-new-tokens 24

Arms, on one loaded model: ``plain`` (target-only decoding, ``pdflash.offload.generate``) and one
``spec:<predictor>`` arm per route-ahead predictor (``none`` = no route-ahead), all greedy. Random
weights accept nothing, so the speculative arms run in oracle-acceptance mode: the draft runs for
real, its proposals are replaced by the target's greedy tokens with mismatches at rate 1 - P
(``pdflash.draft.oracle``). Every arm decodes the same tokens. The reference continuation of each
prompt comes from the verify path, untimed (``oracle_reference``). ``--block-size`` is ``auto``
(the block planner) unless a fixed N is given; on CUDA plain decoding and every verify block
replay CUDA graphs. Each measured run starts from a cold cache and a cold cost model.

Each (repeat, prompt) pair runs every arm, in an order shuffled per pair with a fixed seed, each
after ``reset_cache()`` (non-terminal: cache, queues and statistics emptied; the model stays
loaded). Per run: tokens/s after the first token, acceptance length, exposed fetch per generated
token, bytes moved per generated token, cache hit rate; route-ahead recall / precision / wasted
bytes. Runtime statistics include the prefill (the same prompt in every arm). The summary gives
per-arm medians and the per-pair speed ratio against ``plain``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdflash import PdflashError

PROMPTS = (
    "The expert cache keeps the most useful experts on the device and",
    "Write a short story about a lighthouse keeper who",
    "def fibonacci(n):\n    ",
    "Explain why the link between host memory and the GPU limits decoding speed:",
)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _encode(rt, n_prompts: int) -> list[list[int]]:
    try:
        tok = rt.tokenizer
        prompts = [tok.encode(t) for t in PROMPTS[:n_prompts]]
    except PdflashError:  # no tokenizer files: fixed ids
        prompts = [[(7 * i + 3 * j + 1) % 200 + 1 for j in range(12)] for i in range(n_prompts)]
    return [p for p in prompts if p]


def _run_plain(rt, prompt: list[int], n: int) -> dict:
    from pdflash.offload.generate import generate

    res = generate(rt, prompt, max_new_tokens=n, eos_token_ids=[], cuda_graphs=rt.device.type == "cuda")
    return {"token_ids": res.token_ids, "tokens_per_second": res.tokens_per_second}


def _run_spec(rt, draft, prompt, n, reference, args, predictor: str) -> dict:
    from pdflash.draft.offloaded import speculative_on_runtime

    res = speculative_on_runtime(rt, draft, prompt, n, block_size=args.block_size, predictor=predictor,
                                 acceptance=args.acceptance, reference=reference, seed=args.seed, eos_token_ids=[])
    out = res.to_dict()
    steps = max(1, res.stats.verify_steps)
    out["draft_ms_per_step"] = out["draft_ms"] / steps
    out["verify_ms_per_step"] = out["verify_ms"] / steps
    return out


def _metrics(rt, result: dict) -> dict:
    st = rt.stats()
    n = len(result["token_ids"])
    exposed = st["exposed_fetch_seconds"]
    row = {
        "tokens": n,
        "tokens_per_second": result["tokens_per_second"],
        "exposed_fetch_ms_per_token": exposed / n * 1e3 if exposed is not None and n else None,
        "bytes_per_token": st["bytes_moved"] / n if n else None,
        "hit_rate": st["cache"]["hit_rate"],
        "route_ahead_band_bytes": next((b["bytes"] for b in st["bands"] if b["band"] == 1), None),
    }
    for key in ("acceptance_length", "acceptance_per_position", "draft_ms_per_step", "verify_ms_per_step",
                "oracle_acceptance", "oracle_divergences", "oracle_refreshes", "oracle_refresh_seconds",
                "block_histogram", "bytes_per_committed_token"):
        if key in result:
            row[key] = result[key]
    if result.get("route_ahead"):
        ra = result["route_ahead"]
        row["route_ahead"] = {k: ra[k] for k in ("predictor", "predicted", "used", "recall", "precision",
                                                 "useful_bytes", "wasted_bytes")}
    return row


def _median(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarise(runs: list[dict]) -> dict:
    arms = sorted({r["arm"] for r in runs})
    plain = {(r["repeat"], r["prompt"]): r for r in runs if r["arm"] == "plain"}
    out = {}
    for arm in arms:
        rows = [r for r in runs if r["arm"] == arm]
        s = {k: _median(rows, k) for k in ("tokens_per_second", "exposed_fetch_ms_per_token", "bytes_per_token",
                                             "hit_rate", "acceptance_length", "draft_ms_per_step", "verify_ms_per_step")}
        ratios = [r["tokens_per_second"] / plain[(r["repeat"], r["prompt"])]["tokens_per_second"]
                  for r in rows if r["tokens_per_second"] and plain.get((r["repeat"], r["prompt"]), {}).get("tokens_per_second")]
        s["speed_vs_plain_median"] = statistics.median(ratios) if ratios else None
        s["speed_vs_plain_range"] = [min(ratios), max(ratios)] if ratios else None
        ra = [r["route_ahead"] for r in rows if "route_ahead" in r]
        if ra:
            s["route_ahead_recall"] = statistics.median(x["recall"] for x in ra)
            s["route_ahead_precision"] = statistics.median(x["precision"] for x in ra)
            s["route_ahead_wasted_bytes"] = statistics.median(x["wasted_bytes"] for x in ra)
        s["runs"] = len(rows)
        out[arm] = s
    return out


def markdown(summary: dict, acceptance: float) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [
        f"Oracle-acceptance mode, P = {acceptance} (speculative arms' proposals are the target's greedy "
        "tokens with mismatches at rate 1 - P; the draft model runs for real).",
        "",
        "| arm | tok/s | vs plain | accept len | exposed fetch ms/tok | MB/tok | hit rate | draft ms/step | verify ms/step | RA recall | RA precision |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, s in summary.items():
        mb = None if s["bytes_per_token"] is None else s["bytes_per_token"] / 1e6
        lines.append(
            f"| {arm} | {f(s['tokens_per_second'], '.2f')} | {f(s['speed_vs_plain_median'], '.2f')}x "
            f"| {f(s['acceptance_length'], '.2f')} | {f(s['exposed_fetch_ms_per_token'], '.2f')} | {f(mb, '.1f')} "
            f"| {f(s['hit_rate'], '.3f')} | {f(s['draft_ms_per_step'], '.2f')} | {f(s['verify_ms_per_step'], '.2f')} "
            f"| {f(s.get('route_ahead_recall'), '.3f')} | {f(s.get('route_ahead_precision'), '.3f')} |"
        )
    return "\n".join(lines)


def run(args) -> dict:
    from pdflash.draft.offloaded import load_runtime_draft
    from pdflash.offload.runtime import OffloadedModel

    model_dir, draft_dir = args.model, args.draft
    if args.synthetic:
        from pdflash.draft.synthetic import write_synthetic_draft
        from pdflash.offload.config import ModelPreset
        from pdflash.offload.synthetic import write_checkpoint

        work = Path(tempfile.mkdtemp(prefix="pdflash-bench-"))
        model_dir, draft_dir = work / "target", work / "draft"
        write_checkpoint(model_dir, ModelPreset.from_name(args.synthetic), mxfp4=True, dtype="bfloat16")
        write_synthetic_draft(draft_dir, "tiny", target_dir=model_dir)
    if model_dir is None or draft_dir is None:
        raise PdflashError("give --model and --draft (or --synthetic tiny)")
    from pdflash.draft.config import read_config_json
    from pdflash.draft.offloaded import draft_block_size

    from pdflash.draft.offloaded import parse_block_size

    args.block_size = parse_block_size(args.block_size)
    max_block = draft_block_size(draft_dir, args.block_size)
    cfg = read_config_json(Path(model_dir) / "config.json", "target")
    total = int(cfg["num_hidden_layers"]) * int(cfg["num_local_experts"])
    size = ({"expert_cache_mib": args.cache_mib} if args.cache_mib is not None
            else {"expert_cache_experts": max(1, round(args.cache_fraction * total))})
    rt = OffloadedModel.load(model_dir, device=args.device, dtype=args.dtype, block_tokens=max_block, link_gbps=args.link_gbps,
                             lookahead_depth=args.lookahead_depth, progress=True, **size)
    slots = rt.cache.capacity
    try:
        draft = load_runtime_draft(rt, draft_dir)  # as generate loads it
        prompts = _encode(rt, args.prompts)
        arms = ["plain"] + [f"spec:{p}" for p in args.predictors.split(",")]
        _log(f"{len(prompts)} prompts x {args.repeats} repeats x arms {arms}; cache {slots}/{total} experts")
        from pdflash.draft.offloaded import oracle_reference, verify_decoder

        references, plain_tokens = [], []
        for p in prompts:  # warm-up: kernels, allocator, graphs; the oracle's reference from the verify path
            rt.reset_cache()
            plain_tokens.append(_run_plain(rt, p, args.max_new_tokens)["token_ids"])
            rt.reset_cache()
            dec = verify_decoder(rt, draft, len(p) + args.max_new_tokens, args.acceptance, at=len(p),
                                 blocks=range(1, max_block + 1))
            references.append(oracle_reference(rt, p, args.max_new_tokens, max_block, decoder=dec))
        rt.reset_cache()
        _run_spec(rt, draft, prompts[0], min(16, args.max_new_tokens), references[0][:16], args, arms[-1][5:])
        rt.forget_costs()  # every measured run starts from the cost model's priors
        runs = []
        for rep in range(args.repeats):
            for pi, p in enumerate(prompts):
                order = arms[:]
                random.Random(args.seed * 1000 + rep * 100 + pi).shuffle(order)
                for arm in order:
                    rt.reset_cache()
                    rt.forget_costs()
                    t0 = time.perf_counter()
                    if arm == "plain":
                        result = _run_plain(rt, p, args.max_new_tokens)
                    else:
                        result = _run_spec(rt, draft, p, args.max_new_tokens, references[pi], args, arm[5:])
                    row = {"arm": arm, "repeat": rep, "prompt": pi, "wall_s": time.perf_counter() - t0, **_metrics(rt, result)}
                    row["same_tokens_as_plain"] = result["token_ids"] == plain_tokens[pi]
                    row["same_tokens_as_reference"] = result["token_ids"] == references[pi]
                    runs.append(row)
                    _log(f"rep {rep} prompt {pi} {arm}: {row['tokens_per_second'] or 0:.2f} tok/s"
                         + (f", accept {row['acceptance_length']:.2f}" if "acceptance_length" in row else ""))
        summary = summarise(runs)
        repairs = sum(r.get("oracle_divergences") or 0 for r in runs)
        if repairs:
            _log(f"note: the oracle repaired {repairs} divergences; their forwards count in the byte and exposed-fetch "
                 "figures (blocks of different lengths round apart in a 16-bit dtype: check that verify_rows is set)")
        return {
            "oracle_acceptance": args.acceptance,
            "config": {
                "model": str(model_dir), "draft": str(draft_dir), "device": str(rt.device), "dtype": str(rt.dtype),
                "expert_format": rt.stats()["expert_format"], "expert_bytes": rt.stats()["expert_bytes"],
                "cache_slots": slots, "total_experts": total, "block_size": args.block_size, "max_block_size": max_block,
                "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "repeats": args.repeats,
                "lookahead_depth": args.lookahead_depth, "link_gbps": args.link_gbps,
            },
            "summary": summary,
            "runs": runs,
            "markdown": markdown(summary, args.acceptance),
        }
    finally:
        rt.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="Target checkpoint directory.")
    ap.add_argument("--draft", type=Path, help="DFlash draft checkpoint directory.")
    ap.add_argument("--synthetic", choices=["tiny"], help="Write a tiny MXFP4 pair to a temporary directory and use it.")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="Compute dtype (default: the checkpoint's): bfloat16, float16 or float32.")
    ap.add_argument("--cache-fraction", type=float, default=0.25, help="Expert cache as a fraction of all experts.")
    ap.add_argument("--cache-mib", type=float, default=None, help="Expert cache in MiB (overrides --cache-fraction).")
    ap.add_argument("--acceptance", type=float, default=0.7, help="Oracle acceptance rate P.")
    ap.add_argument("--block-size", default="auto", help="Verify block size: auto (the block planner, the default) or N.")
    ap.add_argument("--predictors", default="draft-router,previous,none",
                    help="Comma-separated route-ahead predictors, one speculative arm each (none = no route-ahead).")
    ap.add_argument("--lookahead-depth", type=int, default=0, help="The runtime's own lookahead prefetch depth.")
    ap.add_argument("--link-gbps", type=float, default=None, help="Simulated link speed (CPU only).")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="Write the JSON result here (else stdout).")
    args = ap.parse_args(argv)
    try:
        if not 0 <= args.acceptance <= 1:
            raise PdflashError("--acceptance must be in [0, 1]")
        result = run(args)
    except PdflashError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    print(result["markdown"], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
