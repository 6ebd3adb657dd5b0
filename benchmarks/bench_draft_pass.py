"""One draft step of the embedded pair on the CPU: the native draft pass (native/pf_draft.c)
against the same draft's PyTorch operators, alternating in one process.

    python benchmarks/bench_draft_pass.py                     # blocks 2, 4, 8; 300 steps each
    python benchmarks/bench_draft_pass.py --blocks 4 --steps 1000 --out draft_pass.json

A step is what speculative decoding does per drafted block: append the features of the tokens
committed since the last step (``--context`` rows, 2 by default) and draft a block of B in the
same pass, then take the greedy proposals through the target's head; the context is cropped
back afterwards, so every step sees the same ``--prefix`` rows of context. The draft and target
are loaded as ``pdflash generate`` loads them on the CPU (float32 draft, one PyTorch thread).
Also reports the largest difference between the two paths' hidden rows and whether their
proposals agree. Weights stay warm in the caches here, unlike in a decode loop, where the
target's layers run between two draft steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import import_pdflash  # noqa: E402

import_pdflash()

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="2,4,8", help="block lengths, comma-separated")
    ap.add_argument("--steps", type=int, default=300, help="timed steps per path and block")
    ap.add_argument("--context", type=int, default=2, help="context rows appended per step")
    ap.add_argument("--prefix", type=int, default=40, help="context rows before the timed steps")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    try:
        blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        print(f"error: --blocks must be integers separated by commas, got {args.blocks!r}", file=sys.stderr)
        return 2
    if args.steps < 1 or args.context < 0 or args.prefix < 1 or any(b < 2 for b in blocks):
        print("error: --steps and --prefix must be >= 1, --context >= 0 and every block >= 2", file=sys.stderr)
        return 2

    from pdflash.draft.offloaded import load_runtime_draft
    from pdflash.offload.embedded import embedded_draft, embedded_target
    from pdflash.offload.runtime import OffloadedModel

    torch.set_num_threads(1)
    results = {"blocks": {}, "context_rows": args.context, "prefix_rows": args.prefix, "steps": args.steps}
    with OffloadedModel.load(embedded_target(), device="cpu") as rt, torch.inference_mode():
        native = load_runtime_draft(rt, embedded_draft())
        operators = load_runtime_draft(rt, embedded_draft())
        operators.use_native(False)
        if not native.native:
            print("error: the native draft pass is not available here (is the native library built?)", file=sys.stderr)
            return 1
        for b in blocks:
            if b > native.config.block_size:
                print(f"error: block {b} is longer than the draft's trained block {native.config.block_size}", file=sys.stderr)
                return 2
        g = torch.Generator().manual_seed(0)
        feats = torch.randn(1, args.prefix + args.context, native.fc.in_features, generator=g).to(torch.bfloat16)
        for d in (native, operators):
            d.reset_context()
            d.append_context(feats[:, : args.prefix])
        new = feats[:, args.prefix:] if args.context else None

        def step(d, b):
            h = d(d.block_ids(5, b, "cpu"), args.prefix + args.context, context=new)
            ids = d.propose(h[0, 1:])
            d.cache.crop(args.prefix)
            return h, ids

        for b in blocks:
            (hn, idn), (ho, ido) = step(native, b), step(operators, b)
            times = {"native": [], "operators": []}
            for i in range(args.steps + 20):
                for name, d in (("native", native), ("operators", operators))[:: 1 if i % 2 else -1]:
                    t = time.perf_counter()
                    step(d, b)
                    if i >= 20:
                        times[name].append(time.perf_counter() - t)
            med = {k: 1e6 * statistics.median(v) for k, v in times.items()}
            row = {"native_us": med["native"], "operators_us": med["operators"],
                   "speedup": med["operators"] / med["native"],
                   "max_abs_diff": float((hn - ho).abs().max()), "same_proposals": bool(torch.equal(idn, ido))}
            results["blocks"][str(b)] = row
            print(f"block {b}: native {row['native_us']:.0f} us, operators {row['operators_us']:.0f} us "
                  f"({row['speedup']:.2f}x), max |diff| {row['max_abs_diff']:.1e}, same proposals {row['same_proposals']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
