"""Where does a decode step's time go? A torch.profiler view of batch-1 decoding on the GPU.

    python benchmarks/profile_decode.py --checkpoint-dir /data/oss20b-mxfp4 --out-dir prof/
    python benchmarks/profile_decode.py --in-memory --preset gpt-oss-120b --cache-fraction 0.1408 \
        --cuda-graphs --dtype bfloat16 --cpu-experts all --out-dir prof/ --name oss120b_all

Loads the checkpoint (``--in-memory``: a seeded synthetic MXFP4 checkpoint of ``--preset``
generated in host memory, as ``check_hybrid_gpu.py --in-memory`` does; the gpt-oss-120b shape
fits no disk of the GPU machine) with every expert resident (``--cache-fraction`` to offload), decodes
``--warmup`` tokens, then profiles ``--tokens`` tokens and writes:

- ``profile_<name>.txt``: the ops sorted by self CPU time and by self device time;
- ``profile_<name>.json``: per-token wall time, device busy time per token, the time spent in
  the experts modules (CPU wall, measured around each call) and a micro-timing of one layer's
  expert maths (weights + batched apply for top-k experts) with CUDA events.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers (_profiling)

from pdflash.offload.config import ModelPreset
from pdflash.offload.experts import OffloadedExperts
from pdflash.offload.generate import decode_one_token, prefill
from pdflash.offload.runtime import OffloadedModel
from pdflash.offload.synthetic import SyntheticCheckpoint, write_checkpoint


def ensure(path: Path, preset: ModelPreset) -> None:
    if not (path / "config.json").exists():
        write_checkpoint(path, preset, mxfp4=True, seed=0, progress=False)


def expert_microtime(rt, repeat: int = 50) -> dict:
    """One layer's routed expert maths for one token (top-k experts), timed on the device."""
    experts = rt.family.decoder_layers(rt.model)[0].mlp.experts
    kernel, cache = experts.kernel, rt.cache
    K, H = rt.family.top_k, rt.family.hidden
    slots = list(range(K))
    x = torch.randn(K, 1, H, device=rt.device, dtype=rt.dtype)
    times = {"weights": [], "apply": []}
    for _ in range(repeat):
        a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        a.record()
        w = kernel.weights(cache.slots, slots)
        b.record()
        kernel.apply_batched(w, x)
        c.record()
        c.synchronize()
        times["weights"].append(a.elapsed_time(b))
        times["apply"].append(b.elapsed_time(c))
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint-dir", type=Path, default=None, help="written there first if missing")
    ap.add_argument("--in-memory", action="store_true", help="a synthetic checkpoint of --preset in host memory instead")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--cache-fraction", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--name", default="resident")
    ap.add_argument("--cuda-graphs", action="store_true", help="Decode through offload/graphs.py (non-expert parts replayed as CUDA graphs).")
    ap.add_argument("--max-len", type=int, default=None, help="With --cuda-graphs: the decoder's KV length (default: just what the run needs).")
    ap.add_argument("--min-bucket", type=int, default=None, help="With --cuda-graphs: smallest key-length bucket (default GraphedDecoder.MIN_BUCKET; "
                    "--min-bucket equal to --max-len attends over the whole cache every step).")
    ap.add_argument("--dtype", default=None, help="Compute dtype (bfloat16, float32; default the checkpoint's).")
    ap.add_argument("--cpu-experts", default="off", choices=["off", "auto", "auto-model", "all"],
                    help="Hybrid expert execution mode (auto-model: auto without the guard).")
    ap.add_argument("--cprofile", action="store_true",
                    help="Also write profile_<name>_python.txt: cProfile of the decoding thread's Python over --tokens tokens.")
    args = ap.parse_args(argv)
    if (args.checkpoint_dir is None) == (not args.in_memory):
        ap.error("give --checkpoint-dir DIR or --in-memory (one of them)")
    preset = ModelPreset.from_name(args.preset)
    if args.in_memory:
        source = SyntheticCheckpoint(preset, mxfp4=True, seed=0)
    else:
        ensure(args.checkpoint_dir, preset)
        source = args.checkpoint_dir
    args.out_dir.mkdir(parents=True, exist_ok=True)
    total = preset.num_hidden_layers * preset.num_local_experts
    slots = None if args.cache_fraction >= 1 else max(preset.num_experts_per_tok, round(args.cache_fraction * total))
    with OffloadedModel.load(source, device="cuda", dtype=args.dtype, expert_cache_experts=slots,
                             preload=slots is None, cpu_experts=args.cpu_experts.replace("-model", ""),
                             hybrid_guard=args.cpu_experts != "auto-model") as rt:
        wall = {"experts": 0.0}
        orig = OffloadedExperts.forward

        def timed(self, *a, **k):
            t = time.perf_counter()
            try:
                return orig(self, *a, **k)
            finally:
                wall["experts"] += time.perf_counter() - t

        OffloadedExperts.forward = timed
        if args.cuda_graphs:
            from pdflash.offload.graphs import GraphedDecoder

            need = 16 + args.warmup + 3 * args.tokens + 1
            dec = GraphedDecoder(rt, max_len=max(need, args.max_len or 0), graphs=True, min_bucket=args.min_bucket)
            dec.prepare(16)
            step = dec.decode
            tok = int(dec.prefill(torch.arange(16)).argmax(-1))
        else:
            kv = rt.new_kv_cache()
            step = lambda t: decode_one_token(rt, t, kv)  # noqa: E731
            tok = int(prefill(rt, torch.arange(16)[None], kv).argmax(-1))
        for _ in range(args.warmup):
            tok = int(step(tok).argmax(-1))
        torch.cuda.synchronize()
        wall["experts"] = 0.0
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            tok = int(step(tok).argmax(-1))
        plain = (time.perf_counter() - t0) / args.tokens
        experts_share = wall["experts"] / args.tokens
        if args.cprofile:
            import cProfile

            from _profiling import write_cprofile

            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.tokens):
                tok = int(step(tok).argmax(-1))
            torch.cuda.synchronize()
            pr.disable()
            write_cprofile(pr, args.out_dir / f"profile_{args.name}_python.txt", rows=35)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.tokens):
                tok = int(step(tok).argmax(-1))
            torch.cuda.synchronize()
        ka = prof.key_averages()
        dev_attr = "self_device_time_total" if hasattr(next(iter(ka)), "self_device_time_total") else "self_cuda_time_total"
        text = ka.table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n" + ka.table(sort_by=dev_attr, row_limit=40)
        (args.out_dir / f"profile_{args.name}.txt").write_text(text)
        device_us = sum(getattr(e, dev_attr) for e in ka)
        result = {
            "name": args.name, "cache_fraction": args.cache_fraction,
            "max_len": dec.max_len if args.cuda_graphs else None, "min_bucket": dec.min_bucket if args.cuda_graphs else None,
            "buckets_captured": sorted(dec._steps) if args.cuda_graphs else None,
            "cpu_experts": args.cpu_experts, "dtype": str(rt.dtype),
            "ms_per_token": plain * 1e3,
            "experts_cpu_wall_ms_per_token": experts_share * 1e3,
            "device_busy_ms_per_token": device_us / 1e3 / args.tokens,
            "kernel_launches_per_token": sum(e.count for e in ka if e.key.startswith("cudaLaunchKernel")) / args.tokens,
            "expert_micro_ms": expert_microtime(rt),
        }
        OffloadedExperts.forward = orig
    if args.in_memory:
        source.close()
    result["checkpoint"] = f"synthetic in memory: {args.preset}" if args.in_memory else str(args.checkpoint_dir)
    (args.out_dir / f"profile_{args.name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
