"""Hybrid expert execution on a GPU: greedy tokens and speed of --cpu-experts off / auto / all.

    python benchmarks/check_hybrid_gpu.py CKPT --out hybrid.json            # CKPT: gpt-oss-20b-shaped MXFP4
    python benchmarks/check_hybrid_gpu.py /tmp/tiny --device cpu --link-gbps 0.05 --cache-fraction 0.5   # CPU check
    python benchmarks/check_hybrid_gpu.py --in-memory gpt-oss-120b --cache-fraction 0.1408 --out h120.json

For each dtype (``--dtypes``, float32 and bfloat16) and each mode (off: every missing expert
fetched; auto: each layer's misses split between the link and the CPU kernel by the cost
model, checked by the guard against realized decode steps; auto-model: the cost model alone,
no guard (with --cuda-graphs its decode steps are host steps of mode "split": the link and the
CPU side by side inside one graph, each host node also prefetching the next layer's predicted
experts at band 1 (route-ahead); auto-model-noahead, auto-noahead: the same without route-ahead,
PDFLASH_ROUTE_AHEAD=0; auto-model-seg: segments, the split made from Python per layer); auto-host / auto-off: the guard pinned to that arm, e.g. auto-host every miss on the
CPU and the hits on the device (the host and model arms fetch nothing into the cache: it is
filled first with as many experts of each layer as its share of the slots, the hits a fetching
arm would leave); all: every expert on the CPU; MODE-seg (all-seg, auto-seg,
auto-host-seg, ...): MODE with host steps off, so that a graphed step that fetches nothing runs as
segments with the experts module between them instead of one graph with host nodes,
offload/host_graph.py), one greedy generation of ``--tokens`` tokens after a
fixed prompt with an expert cache of ``--cache-fraction`` of all experts (plain decoding,
eager: CUDA graphs off so the three modes run the same code around the experts). Reports the
token ids' agreement with the fetch-only run of the same dtype (the aim in float32:
identical), tokens per second, and per token the experts served from the cache, fetched and
computed on the CPU, with the CPU and link time, and the guard's first 96 steps (arm, tokens, ms,
how it counted). One JSON object (stdout with --json, or --out).
``--cuda-graphs`` decodes through the graphed decoder (what ``generate`` does on CUDA);
``--link-gbps 25 --cpu-threads 8`` on CUDA emulates a desktop (PCIe 4.0 x16, an 8-core CPU).
``--prewake-us 0,500`` runs every mode that computes on the CPU once per value: how long the
kernel's pool, woken when a layer's routing copy starts, polls for the layer's call (0: it
sleeps until the call; the runtime's default is CpuExpertRunner.prewake_us).
``--in-memory PRESET`` runs a seeded synthetic checkpoint of that preset generated in host
memory (offload/synthetic.py; gpt-oss-120b's 65 GB do not fit the GPU machine's disk) instead of
CKPT: MXFP4 experts for a gpt-oss preset, FP8 ones (128 x 128 blocks, as Qwen/Qwen3-30B-A3B-FP8)
for a Qwen3-MoE preset.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import time
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import import_pdflash  # noqa: E402
from _profiling import write_cprofile  # noqa: E402

import_pdflash()

from pdflash.offload.generate import generate  # noqa: E402
from pdflash.offload.runtime import OffloadedModel  # noqa: E402

PROMPT = [200, 1000, 31, 9, 77, 4000, 250, 17, 3, 44, 81, 90, 123, 7, 66, 19]


def run_one(ckpt, device: str, dtype: str, mode: str, args, prewake_us: int | None = None) -> dict:
    """One generation in ``mode``; ``prewake_us`` (None: the runtime's default) is this runtime's
    CPU runner's prewake poll."""
    asked, segmented, plan_only = mode, mode.endswith("-seg"), mode.endswith("-noahead")
    mode = mode.removesuffix("-seg").removesuffix("-noahead")
    with _env("PDFLASH_HOST_STEPS", not segmented), _env("PDFLASH_ROUTE_AHEAD", not plan_only), OffloadedModel.load(ckpt, device=device, dtype=dtype,
                                                         cpu_experts="auto" if mode.startswith("auto") else mode,
                             cpu_threads=args.cpu_threads, link_gbps=args.link_gbps, hybrid_guard=mode != "auto-model",
                             workers=args.workers, chunk_mib=args.chunk_mib,
                             expert_cache_experts=None if mode == "all" else args._slots) as rt:
        if prewake_us is not None and rt.cpu is not None:
            rt.cpu.prewake_us = prewake_us  # this runner only
        if mode.startswith("auto-") and mode != "auto-model" and rt.placer is not None:
            rt.placer.guard.pin(mode[len("auto-"):])  # that arm's steady steps, no trials
        vocab = int(rt.config.vocab_size)
        prompt = [t % vocab for t in PROMPT]
        graphs = bool(args.cuda_graphs)
        generate(rt, prompt, max_new_tokens=2, eos_token_ids=[], cuda_graphs=graphs)  # warm-up (allocations, calibration)
        rt.reset_cache()
        if mode.startswith(("auto-host", "auto-model")) and rt.cache.capacity > rt.host.num_layers:
            # the host arm fetches nothing: give it the share of hits a fetching arm leaves in the
            # cache (the same experts of every layer; routing is uniform on these checkpoints)
            per = rt.cache.capacity // rt.host.num_layers
            rt.cache.fill((layer, e) for layer in range(rt.host.num_layers) for e in range(per))
        guard = rt.placer.guard if rt.placer is not None else None
        if guard is not None:
            guard.trace_limit, guard.trace = 96, []
        bd = _Breakdown(rt) if args.breakdown else None
        prof = cProfile.Profile() if args.cprofile else None
        if prof is not None:
            prof.enable()
        res = generate(rt, prompt, max_new_tokens=args.tokens, eos_token_ids=[], cuda_graphs=graphs)
        if prof is not None:
            prof.disable()
            write_cprofile(prof, args.cprofile / f"{dtype}_{mode}.txt")
        breakdown = bd.close() if bd is not None else None
        st = rt.stats()
        vram = None
        if rt.device.type == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(rt.device)
            vram = total - free  # everything this process holds on the GPU (cache, weights, context)
        return {"dtype": dtype, "prewake_us": getattr(rt.cpu, "prewake_us", None) if mode != "off" else None,
                "host_steps_enabled": not segmented, "host_steps": st["cpu_experts"].get("host_steps"),
                "host_handoff": st["cpu_experts"].get("host_handoff"), "fused_attention": _fused_attention(rt),
                "fused_residual": _fused_residual(rt),
                "gpu_device_used_bytes": vram, "mode": st["cpu_experts"]["mode"], "asked": asked, "cuda_graphs": graphs,
                "link_gbps": args.link_gbps, "link_emulated": st.get("link_emulated", False),
                "cpu_threads": st["cpu_experts"].get("threads"), "scheduler_workers": rt.scheduler.workers,
                "token_ids": res.token_ids,
                "tokens_per_second": res.tokens_per_second, "tpot_ms": res.tpot_ms,
                "experts_per_token": st["experts_per_token"], "cpu_experts": st["cpu_experts"],
                "link_busy_seconds": st["link_busy_seconds"], "exposed_fetch_seconds": st["exposed_fetch_seconds"],
                "bytes_per_token": st["bytes_per_token"], "cache_slots": st["cache"]["slots"],
                "cost_model": rt.cost.to_dict(), "layer_breakdown_us": breakdown,
                "guard_trace": [list(t) for t in guard.trace] if guard is not None else None}


@contextlib.contextmanager
def _env(name: str, on: bool):
    """The switch ``name`` ("1" / "0") for the runtimes (and graphed decoders) made inside."""
    old = os.environ.get(name)
    os.environ[name] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _fused_residual(rt) -> bool | None:
    """Whether the host steps summed each layer's experts into the residual stream in one kernel
    (host_graph.moe_residual); None where no host step ran."""
    steps = rt.__dict__.get("_host_steps")
    return None if steps is None else bool(steps.fused_residual)


def _fused_attention(rt) -> bool:
    """Whether the graphs run the fused gpt-oss layer (offload/attn_triton.py)."""
    from pdflash.offload import attn_triton

    return rt.family.model_type == "gpt_oss" and attn_triton.available(rt.device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", nargs="?", default=None)
    ap.add_argument("--in-memory", default=None, metavar="PRESET",
                    help="a synthetic checkpoint of this preset generated in host memory (gpt-oss: MXFP4; Qwen3-MoE: FP8), instead of CKPT")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="off,auto,all")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cache-fraction", type=float, default=0.25)
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--workers", type=int, default=2, help="the fetch scheduler's copy workers (the runtime's default: 2)")
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="the scheduler's chunk size in MiB (the runtime's default: 4)")
    ap.add_argument("--link-gbps", type=float, default=None,
                    help="a link of this many GB/s: simulated on the CPU device, real copies paced to it on CUDA")
    ap.add_argument("--cuda-graphs", action="store_true", help="decode through the graphed decoder (the CUDA default of generate)")
    ap.add_argument("--cprofile", type=Path, default=None, metavar="DIR",
                    help="profile each timed generation (cProfile; slows it) and write DIR/<dtype>_<mode>.txt")
    ap.add_argument("--breakdown", action="store_true",
                    help="time each decode step's expert layers by part (routing copy, kernel, result copy, between layers)")
    ap.add_argument("--prewake-us", default=None, metavar="US[,US...]",
                    help="run each mode that computes on the CPU once per value: the pool's poll after a layer's prewake (0: none)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        prewakes = [int(v) for v in args.prewake_us.split(",")] if args.prewake_us else [None]
    except ValueError:
        ap.error(f"--prewake-us: comma-separated integers, got {args.prewake_us!r}")
    if any(v is not None and not 0 <= v <= 100_000 for v in prewakes):
        ap.error("--prewake-us: values in 0 .. 100000")
    base = ("off", "auto", "auto-model", "auto-host", "auto-all", "auto-off", "all")
    known = base + tuple(f"{m}-seg" for m in base if m != "off") + ("auto-model-noahead", "auto-noahead")
    bad = [m for m in args.modes.split(",") if m not in known]
    if bad:
        ap.error(f"unknown mode(s) {', '.join(bad)}: use {', '.join(known)}")
    if (args.ckpt is None) == (args.in_memory is None):
        ap.error("give a checkpoint directory or --in-memory PRESET (one of them)")
    source = args.ckpt
    if args.in_memory:
        from pdflash.offload.config import ModelPreset
        from pdflash.offload.synthetic import SyntheticCheckpoint

        preset = ModelPreset.from_name(args.in_memory)
        qwen = preset.family == "qwen3_moe"
        source = SyntheticCheckpoint(preset, mxfp4=not qwen, quant="fp8" if qwen else None, seed=0)
        cfg = source.config
    else:
        cfg = json.loads((Path(args.ckpt) / "config.json").read_text())
    total = int(cfg["num_hidden_layers"]) * int(cfg.get("num_local_experts") or cfg["num_experts"])
    need = int(cfg["num_experts_per_tok"])
    args._slots = max(need, int(total * args.cache_fraction))
    runs = []
    for dtype in args.dtypes.split(","):
        ref = None
        for mode, pw in [(m, p) for m in args.modes.split(",") for p in (prewakes if m != "off" else [None])]:
            r = run_one(source, args.device, dtype, mode, args, pw)
            if ref is None:
                ref = r["token_ids"]
            r["identical_to_first_mode"] = r["token_ids"] == ref
            r["first_difference"] = next((i for i, (a, b) in enumerate(zip(r["token_ids"], ref)) if a != b), None)
            runs.append(r)
            ept = r["experts_per_token"]
            label = mode if pw is None else f"{mode}/prewake {pw}"
            if r["host_steps"]:
                label += f" ({r['host_steps']} host steps)"
            print(f"{dtype:9s} {label:4s} ({r['mode']}): {r['tokens_per_second'] or 0:7.2f} tok/s  experts/token cache "
                  f"{ept['cache'] or 0:.2f} fetched {ept['fetched'] or 0:.2f} cpu {ept['cpu'] or 0:.2f}  "
                  f"identical {r['identical_to_first_mode']}{_guard_text(r)}", file=sys.stderr)
            ra = r["cpu_experts"].get("route_ahead") or {}
            if ra.get("sent"):
                print(f"    route-ahead: {ra['sent']} sent, {ra['used']} used, {ra['cancelled']} cancelled", file=sys.stderr)
            for mode_, t in (r["cpu_experts"].get("host_timeline_ms") or {}).items():
                print(f"    host steps ({mode_}, {t['steps']}), ms per step: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in t.items() if k != "steps"), file=sys.stderr)
            if r["layer_breakdown_us"]:
                print("    per decode layer, us: " + ", ".join(f"{k} {v:.0f}" for k, v in r["layer_breakdown_us"].items()
                                                           if k != "layers"), file=sys.stderr)
    if args.in_memory:
        source.close()
    out = {"ckpt": args.ckpt or f"synthetic in memory: {args.in_memory}", "synthetic_in_memory": bool(args.in_memory), "device": args.device, "cache_slots": args._slots, "total_experts": total,
           "cuda_graphs": bool(args.cuda_graphs), "link_gbps": args.link_gbps, "cpu_threads": args.cpu_threads,
           "emulated": args.device == "cuda" and args.link_gbps is not None, "runs": runs}
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    return 0


class _Breakdown:
    """Wall time of each decode layer's expert module by part, from wrappers around the parts
    (installed for one generation, removed by close()): the routing copy to the host (it waits
    for the device to finish the layer's attention), the native kernel call, the rest of the
    host path (_cpu_compute beside the kernel), the result copy back, the rest of the module's
    forward, and the time from one layer's end to the next layer's start (the device's next
    graph segment launched, hooks). Layers of one token only (decode)."""

    def __init__(self, rt):
        from pdflash.native.cpu_experts import CpuExperts
        from pdflash.offload import experts as ex
        from pdflash.offload.host_exchange import HostExchange

        self.sums: dict[str, float] = {}
        self.layers = 0
        self._end: float | None = None
        self._saved = [(HostExchange, "routing", HostExchange.routing), (HostExchange, "upload", HostExchange.upload),
                       (ex.OffloadedExperts, "forward", ex.OffloadedExperts.forward),
                       (ex.OffloadedExperts, "_cpu_compute", ex.OffloadedExperts._cpu_compute),
                       (CpuExperts, "_experts", CpuExperts._experts)]
        self._on = False
        timed = self._timed
        HostExchange.routing = timed("routing_copy", HostExchange.routing)
        HostExchange.upload = timed("result_copy", HostExchange.upload)
        ex.OffloadedExperts._cpu_compute = timed("cpu_compute_call", ex.OffloadedExperts._cpu_compute)
        CpuExperts._experts = timed("kernel_call", CpuExperts._experts)
        fwd = ex.OffloadedExperts.forward

        def forward(module, hidden_states, *a, **k):
            t0 = time.perf_counter()
            one = hidden_states.reshape(-1, hidden_states.shape[-1]).shape[0] == 1
            self._on = one
            if one and self._end is not None and t0 - self._end < 0.1:
                self._add("between_layers", t0 - self._end)
            out = fwd(module, hidden_states, *a, **k)
            t1 = time.perf_counter()
            if one:
                self._add("module", t1 - t0)
                self.layers += 1
            self._on = False
            self._end = t1 if one else None
            return out

        ex.OffloadedExperts.forward = forward

    def _add(self, key: str, dt: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + dt

    def _timed(self, key: str, fn):
        def wrapper(*a, **k):
            if not self._on:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._add(key, time.perf_counter() - t0)
        return wrapper

    def close(self) -> dict:
        for owner, name, value in self._saved:
            setattr(owner, name, value)
        n = max(1, self.layers)
        out = {k: v / n * 1e6 for k, v in self.sums.items()}
        if "cpu_compute_call" in out:
            out["cpu_compute_beside_kernel"] = out.pop("cpu_compute_call") - out.get("kernel_call", 0.0)
        if "module" in out:
            out["module_rest"] = out["module"] - sum(out.get(k, 0.0) for k in ("routing_copy", "cpu_compute_beside_kernel",
                                                                                "kernel_call", "result_copy"))
        out["layers"] = self.layers
        return out


def _guard_text(run: dict) -> str:
    """The guard's kept arm and its last medians per arm (ms per decode step), for the console."""
    g = (run.get("cpu_experts") or {}).get("guard")
    if not g:
        return ""
    ms = ", ".join(f"{k[:-3]} {v:.1f}" for k, v in g.items() if k.endswith("_ms") and v is not None)
    return f"  guard: {g.get('arm')} ({ms + ' ms/step' if ms else 'no check yet'})"


if __name__ == "__main__":
    sys.exit(main())
