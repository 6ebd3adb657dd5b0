"""One draft step, eager against the static-cache passes (draft/graphed.py: CUDA graphs on a GPU),
alternating in one process.

    # on the GPU machine (the pair bench_speculation_gpu.py writes, written here on first use)
    python benchmarks/bench_draft_graphs.py --checkpoint-dir /tmp/spec/oss20b --dtype float32 --out draft_graphs.json

    # anywhere, the same code paths in seconds (tiny pair: the static passes run eagerly on a CPU)
    python benchmarks/bench_draft_graphs.py --preset tiny --device cpu --checkpoint-dir /tmp/spec-tiny \\
        --steps 20 --out /tmp/draft_graphs.json

A step is what speculative decoding does per drafted block: append the target features of the
tokens committed since the last step (``--context`` rows, default 2) and draft a block of B in
the same pass, then take the greedy proposals through the target's head, synchronised. The
context is cropped back after each step, so every step sees the same ``--prefix`` positions. The
draft is loaded as ``pdflash generate`` loads it (the target's dtype on a GPU); the target's
experts are not touched (only its embeddings and head are used). Per block length: the median
step time of each path, their ratio, the largest difference between the two paths' hidden rows
and whether their proposals agree. One JSON object goes to --out, a table to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import import_pdflash  # noqa: E402

import_pdflash()

import torch  # noqa: E402

from bench_speculation_gpu import ensure_checkpoint, write_result  # noqa: E402
from pdflash.machine import machine_info  # noqa: E402


def _step(draft, block_ids, start: int, context, sync) -> tuple[float, torch.Tensor, torch.Tensor]:
    """One timed draft step; returns (seconds, hidden [1, B, H], proposals [B-1])."""
    t0 = time.perf_counter()
    hidden = draft(block_ids, start, context=context)
    proposals = draft.propose(hidden[0, 1:])
    sync()
    return time.perf_counter() - t0, hidden, proposals


def measure(rt, draft_dir: Path, blocks: list[int], steps: int, context: int, prefix: int) -> dict:
    from pdflash.draft.offloaded import draft_pass_kind, load_runtime_draft

    dev = rt.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    eager = load_runtime_draft(rt, draft_dir)
    static = load_runtime_draft(rt, draft_dir)
    static.use_native(False)
    trained = eager.config.block_size
    blocks = [b for b in blocks if 2 <= b <= trained]
    static.use_graphs(prefix + context + 8, before_capture=rt.cache.drain, at=prefix, blocks=blocks)
    eager.warm_up(blocks)
    feats_dim, vocab = eager.fc.in_features, eager.config.mask_token_id
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn((1, prefix + context, feats_dim), generator=gen).to(device=dev, dtype=eager.fc.weight.dtype)
    out = {"paths": {"eager": draft_pass_kind(eager), "static": draft_pass_kind(static)}, "blocks": {}}
    with torch.inference_mode():
        for d in (eager, static):
            d.reset_context()
            d.append_context(feats[:, :prefix])
        for b in blocks:
            times = {"eager": [], "static": []}
            diff, agree = 0.0, True
            for i in range(steps + 3):
                ids = eager.block_ids(i % vocab, b, dev)
                got = {}
                for name, d in ((("eager", eager), ("static", static)))[:: 1 if i % 2 else -1]:
                    s, hidden, props = _step(d, ids, prefix + context, feats[:, prefix:], sync)
                    d.cache.crop(prefix)
                    got[name] = (hidden.float(), props)
                    if i >= 3:  # the first steps of a shape are warm-up
                        times[name].append(s)
                diff = max(diff, float((got["eager"][0] - got["static"][0]).abs().max()))
                agree = agree and torch.equal(got["eager"][1], got["static"][1])
            med = {k: statistics.median(v) for k, v in times.items()}
            out["blocks"][str(b)] = {"eager_ms": 1e3 * med["eager"], "static_ms": 1e3 * med["static"],
                                     "speedup": med["eager"] / med["static"], "max_abs_diff": diff,
                                     "proposals_agree": agree}
        out["paths_after"] = {"eager": draft_pass_kind(eager), "static": draft_pass_kind(static)}
    return out


def markdown(result: dict) -> str:
    p = result["paths"]
    lines = [f"| B | eager ({p['eager']}) ms | {p['static']} ms | speedup | max abs diff | proposals agree |",
             "|---:|---:|---:|---:|---:|---|"]
    for b, r in result["blocks"].items():
        lines.append(f"| {b} | {r['eager_ms']:.2f} | {r['static_ms']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['max_abs_diff']:.2e} | {r['proposals_agree']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint-dir", type=Path, required=True, help="Target checkpoint (draft in DIR/draft); written if missing.")
    ap.add_argument("--preset", default="gpt-oss-20b", help="Shape of a checkpoint to write: gpt-oss-20b or tiny.")
    ap.add_argument("--draft-preset", default=None, help="Draft shape (default: gpt-oss-20b-DFlash, tiny for --preset tiny).")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--blocks", default="2,4,8", help="Comma-separated block lengths (capped at the draft's).")
    ap.add_argument("--steps", type=int, default=100, help="Timed steps per path and block.")
    ap.add_argument("--context", type=int, default=2, help="Context rows appended per step.")
    ap.add_argument("--prefix", type=int, default=40, help="Context positions before the timed steps.")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        print(f"error: --blocks must be whole numbers separated by commas, got {args.blocks!r}", file=sys.stderr)
        return 2
    if args.steps < 1 or args.context < 1 or args.prefix < 1 or any(b < 2 for b in blocks):
        print("error: --steps, --context and --prefix must be >= 1 and every block >= 2", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible; use --device cpu", file=sys.stderr)
        return 2

    from pdflash.offload.runtime import OffloadedModel

    t0 = time.perf_counter()
    draft_preset = args.draft_preset or ("tiny" if args.preset == "tiny" else "gpt-oss-20b-DFlash")
    made = ensure_checkpoint(args.checkpoint_dir, args.preset, draft_preset, seed=0)
    # the experts are not used: the smallest cache the loader takes
    with OffloadedModel.load(args.checkpoint_dir, device=args.device, dtype=args.dtype, expert_cache_experts=64,
                             cpu_experts="off") as rt:
        result = {"machine": machine_info(), "config": {**vars(args), "checkpoint_dir": str(args.checkpoint_dir),
                                                         "out": str(args.out)},
                  "make_checkpoint_seconds": made}
        result.update(measure(rt, args.checkpoint_dir / "draft", blocks, args.steps, args.context, args.prefix))
    result["wall_seconds"] = time.perf_counter() - t0
    result["markdown"] = markdown(result)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
