"""Eviction policies of the expert cache replayed on random routing (CPU, no model).

Forwards of B tokens walk the layers in order; each token routes top-k of E experts at random; a
layer looks up all its experts before requesting its misses (as offload/experts.py does). The real
ExpertCache with the memcpy scheduler and tiny rows: what is measured is the policy, not the link.

    python benchmarks/bench_eviction.py                       # gpt-oss-20b and -120b shapes, B = 1, 2, 4, 8
    python benchmarks/bench_eviction.py --out eviction.json

Reports per shape, block length and policy: copies per layer per forward (the union of a
block's routes is what a cache that keeps nothing copies) and the host time the cache's lookups
and requests took per forward (the forward pass's thread pays it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from pdflash.draft.planner import distinct_experts
from pdflash.native import Scheduler
from pdflash.offload.cache import EVICTION_POLICIES, ExpertCache
from pdflash.offload.host_store import ExpertLayout, HostStore

SHAPES = {  # layers, experts, top-k, cache slots (25 % of the 20b's experts; 8 GiB of 120b's 13.2 MB experts)
    "gpt-oss-20b": (24, 32, 4, 192),
    "gpt-oss-120b": (36, 128, 4, 600),
}


def replay(policy: str, layers: int, experts: int, top_k: int, slots: int, block: int, forwards: int,
           warmup: int, seed: int, cache_cls=ExpertCache, after_forward=None) -> dict:
    """One replay; ``cache_cls`` builds the cache (tests pass a checked subclass) and
    ``after_forward(cache)``, if given, runs after each forward."""
    host = HostStore(ExpertLayout.build([("w", (16,), torch.uint8)], quantized=False), layers, experts, pin=False)
    rng = random.Random(seed)
    host_s = 0.0
    with Scheduler(backend="memcpy", workers=2) as sched:
        cache = cache_cls(host, sched, torch.device("cpu"), n_slots=slots, policy=policy)
        for step in range(warmup + forwards):
            if step == warmup:
                cache.zero_stats()
                host_s = 0.0
            cache.begin_forward(block)
            for layer in range(layers):
                used = sorted(set().union(*(rng.sample(range(experts), top_k) for _ in range(block))))
                t0 = time.perf_counter()
                misses = [e for e in used if cache.lookup(layer, e) is None]
                fetches = [cache.request(layer, e) for e in misses]
                host_s += time.perf_counter() - t0
                for f in fetches:
                    cache.wait(f)
                cache.end_layer()
            if after_forward is not None:
                after_forward(cache)
        st = cache.stats
    return {"copies_per_layer": st.demand_fetches / forwards / layers,
            "union_per_layer": distinct_experts(block, experts, top_k),
            "hit_rate": st.hit_rate(), "host_ms_per_forward": 1e3 * host_s / forwards}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"Comma-separated: {', '.join(SHAPES)}.")
    ap.add_argument("--blocks", default="1,2,4,8", help="Comma-separated block lengths (tokens per forward).")
    ap.add_argument("--policies", default="lru,balanced", help=f"Comma-separated: {', '.join(EVICTION_POLICIES)}.")
    ap.add_argument("--forwards", type=int, default=30, help="Measured forwards per replay.")
    ap.add_argument("--warmup", type=int, default=10, help="Forwards before measuring (the cache fills).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [s for s in shapes if s not in SHAPES] + [p for p in policies if p not in EVICTION_POLICIES]
    if bad:
        print(f"Error: unknown shape or policy {', '.join(bad)}", file=sys.stderr)
        return 2
    try:
        blocks = [int(b) for b in args.blocks.split(",") if b.strip()]
    except ValueError:
        print(f"Error: --blocks must be comma-separated integers, got {args.blocks!r}", file=sys.stderr)
        return 2
    if not blocks or min(blocks) < 1 or args.forwards < 1 or args.warmup < 0:
        print("Error: blocks and --forwards must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    rows = []
    print("| shape | B | policy | copies / layer | union / layer | hit rate | host ms / forward |\n|---|---:|---|---:|---:|---:|---:|")
    for shape in shapes:
        for block in blocks:
            for policy in policies:
                r = {"shape": shape, "block": block, "policy": policy,
                     **replay(policy, *SHAPES[shape], block, args.forwards, args.warmup, args.seed)}
                rows.append(r)
                print(f"| {shape} | {block} | {policy} | {r['copies_per_layer']:.2f} | {r['union_per_layer']:.2f} | "
                      f"{r['hit_rate']:.1%} | {r['host_ms_per_forward']:.2f} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                        "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
