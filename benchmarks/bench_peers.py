"""Peer baselines next to pdflash: transformers fully on the GPU, and transformers + accelerate
offload with the GPU capped at pdflash's budget (``pdflash.bench.peers`` does the work).

    python benchmarks/bench_peers.py CKPT --arms transformers-resident --device cpu --new-tokens 8
    python benchmarks/bench_peers.py CKPT --cache-fraction 0.25 --json --out peers.json   # GPU

CKPT is a gpt-oss checkpoint directory (bf16 or MXFP4), e.g. one written by
``pdflash make-synthetic --preset gpt-oss-20b CKPT --mxfp4``. The GPU budget of the accelerate
arm is ``--gpu-budget-gib``, or else pdflash's weight memory for ``--cache-fraction`` of the
experts (non-expert weights in the compute dtype + that fraction of the experts as stored).
``--pdflash-tps`` adds the ratios pdflash tokens/s / peer tokens/s.

Results go to stdout (a table, or one JSON object with ``--json``) and to ``--out``; progress
goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ itself, also when imported by path
from _checkout import import_pdflash as _import_pdflash  # noqa: E402


def _check_writable(path: Path) -> None:
    from pdflash import PdflashError

    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise PdflashError(f"--out {path} is a directory: give a file path")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise PdflashError(f"--out {path} cannot be written: {parent} is not a writable directory")


def _table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(x, spec):
        return "missing" if x is None else format(x, spec)

    t = Table(title=f"Peers on {result['config']['model_dir']}")
    for col in ("arm", "tokens/s", "decode tokens", "TTFT ms", "TPOT ms", "GPU peak GiB", "experts impl", "ratio"):
        t.add_column(col)
    ratios = result.get("ratios") or {}
    for r in result["arms"]:
        ratio = ratios.get(r["arm"], {}).get("ratio")
        t.add_row(
            r["arm"], fmt(r["tokens_per_second"], ".2f"), str(r["decode_tokens"]), fmt(r["ttft_ms"], ".1f"),
            fmt(r["tpot_ms"], ".1f"), fmt(r["gpu_memory_peak_gib"], ".2f"), str(r["notes"].get("experts_implementation")),
            fmt(ratio, ".2f") if ratios else "-",
        )
    Console(width=None if sys.stdout.isatty() else 160).print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", help="The gpt-oss checkpoint directory (bf16 or MXFP4).")
    ap.add_argument("--arms", default="transformers-resident,transformers-accelerate-offload",
                    help="Comma-separated arms to run, in this order.")
    ap.add_argument("--gpu-budget-gib", type=float, default=None, help="GPU memory cap of the accelerate arm, in GiB.")
    ap.add_argument("--cache-fraction", type=float, default=0.25,
                    help="Without --gpu-budget-gib: the budget is pdflash's weight memory with this fraction of the experts cached.")
    ap.add_argument("--new-tokens", type=int, default=32, help="Tokens per prompt in the resident arm.")
    ap.add_argument("--offload-new-tokens", type=int, default=4, help="Tokens per prompt in the accelerate arm.")
    ap.add_argument("--time-limit-s", type=float, default=120.0, help="Decode time limit per arm in seconds (0: prefill of one prompt only).")
    ap.add_argument("--warmup-tokens", type=int, default=4, help="Discarded warm-up tokens before the resident arm.")
    ap.add_argument("--prompt", action="append", default=None, help="A prompt text (repeatable); default: three built-in prompts.")
    ap.add_argument("--device", default=None, help="Device of the resident arm (default: cuda when available, else cpu).")
    ap.add_argument("--dtype", default="bfloat16", help="Compute dtype: bfloat16, float16 or float32.")
    ap.add_argument("--attn", default="eager", help="transformers attention implementation (gpt_oss: eager, flex_attention).")
    ap.add_argument("--experts-implementation", default=None, help="transformers experts implementation (default: its own choice).")
    ap.add_argument("--pdflash-tps", type=float, default=None, help="pdflash's tokens/s on the same prompts, for the ratios.")
    ap.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
    ap.add_argument("--out", type=Path, default=None, help="Also write the JSON result to this file.")
    args = ap.parse_args(argv)

    _import_pdflash()
    from pdflash import PdflashError

    try:
        import torch

        from pdflash.bench import peers
        from pdflash.machine import machine_info

        if args.out is not None:
            _check_writable(args.out)
        arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        texts = tuple(args.prompt) if args.prompt else peers.DEFAULT_PROMPTS
        budget = args.gpu_budget_gib
        if budget is None and peers.ACCELERATE_OFFLOAD in arms:
            budget = peers.gpu_budget_bytes(args.model_dir, args.cache_fraction, args.dtype) / peers.GIB
        cfg = peers.PeerConfig(
            model_dir=str(args.model_dir), prompts=peers.encode_prompts(args.model_dir, texts), gpu_budget_gib=budget,
            arms=arms, new_tokens=args.new_tokens, offload_new_tokens=args.offload_new_tokens,
            time_limit_s=args.time_limit_s, warmup_tokens=args.warmup_tokens, dtype=args.dtype,
            attn_implementation=args.attn, experts_implementation=args.experts_implementation, device=device,
        )
        results = peers.run_peers(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    except PdflashError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return exc.exit_code
    config = {k: v for k, v in vars(cfg).items() if k != "prompts"}
    config.update(prompts=list(texts), prompt_tokens=[len(p) for p in cfg.prompts], cache_fraction=args.cache_fraction
                  if args.gpu_budget_gib is None else None)
    result = {
        "config": config,
        "machine": machine_info(device),
        "arms": results,
        "ratios": peers.tokens_per_second_ratios({"tokens_per_second": args.pdflash_tps}, results)
        if args.pdflash_tps is not None else None,
    }
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        _table(result)
    failed = [r for r in results if "error" in r["notes"]]
    for r in failed:
        print(f"Error: arm {r['arm']} failed: {r['notes']['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
