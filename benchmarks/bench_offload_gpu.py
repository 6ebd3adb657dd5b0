"""GPU benchmark of the offload runtime on a synthetic model shape (random weights): by default
the gpt-oss-20b shape with MXFP4 experts; ``--preset qwen3-30b-a3b`` the Qwen3-30B-A3B shape with
bf16 experts, ``--quant fp8`` its FP8 release's format.

    python benchmarks/bench_offload_gpu.py --checkpoint-dir /data/oss20b-mxfp4 --out bench_offload_gpu.json
    python benchmarks/bench_offload_gpu.py --in-memory --preset qwen3-30b-a3b --quant fp8 --out q3_fp8.json

``--in-memory`` generates the synthetic weights in host memory (offload/synthetic.py
SyntheticCheckpoint: the bytes write_checkpoint would write) instead of reading a checkpoint
directory: the 61 GB of a bf16 Qwen3-30B-A3B do not fit the GPU machine's disk. After loading,
every run takes the same code path; results say ``"synthetic_in_memory": true``.

(``--preset tiny --device cpu --link-gbps 1``, or ``--preset qwen3-tiny``, runs the same code
paths on a CPU in seconds.)

Runs, all in one process, greedy batch-1 decoding of the same prompt:

1. link:       pinned host -> device bandwidth, measured with a plain PyTorch copy (1 GiB and
               expert-sized copies) and through the native scheduler (every expert, once);
2. resident:   pdflash with every expert in the device cache (preloaded): the step-time floor;
3. offload-N%: pdflash with a cache of N % of the experts (default 25 %), without prefetch and
               with lookahead prefetch, from a cold cache (``reset_cache``) each;
4. transformers: for a gpt-oss checkpoint directory, GptOssForCausalLM.from_pretrained on it,
               experts dequantized to bf16 by transformers itself (Mxfp4Config(dequantize=True)),
               fully on the GPU (with ``--dtype float32`` every bf16 tensor is then cast to float32:
               an all-float32 reference, since the dequantized values are exact in both dtypes);
               otherwise (Qwen3-MoE, --in-memory) transformers' own model of the family with the
               same weights (FP8 dequantized to bf16) all on the GPU, built by
               bench/peers.load_transformers_reference with the attention transformers picks.

Greedy tokens are compared as the equal prefix; where two runs part, the top-1 minus top-2
logit margin of both at that step is recorded (random weights give near-ties that any change
of summation order flips).

For each pdflash run, over the measured decode tokens (after a warm-up): tokens/s, time per
token, exposed fetch per token (time blocked in the scheduler's wait, by band), bytes moved per
token, hit rate, link busy share, and the link bound

    bound time per token = bytes moved per token / measured pinned bandwidth + resident step time

with utilisation = bound / measured time per token (the issue aims for >= 0.85). A checkpoint
directory (about 13 GB for gpt-oss-20b MXFP4) is written on first use (seeded) and reused. Everything is written to
--out as one JSON object; a short summary goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from pdflash import PdflashError
from pdflash.machine import machine_info
from pdflash.offload.cache import DEFAULT_EVICTION
from pdflash.offload.config import ModelPreset
from pdflash.offload.generate import decode_one_token, prefill
from pdflash.offload.runtime import OffloadedModel
from pdflash.offload.synthetic import SyntheticCheckpoint, write_checkpoint

DEVICE = "cuda"
TF_RUN = "transformers-resident-bf16"  # the reference run's name ("-float32" with --dtype float32)


def sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- checkpoint ------------------------------------------------------------------------------------
def ensure_checkpoint(path: Path, preset: ModelPreset, quant: str | None, seed: int) -> dict:
    try:
        from pdflash.offload.checkpoint import Checkpoint

        with Checkpoint(path) as ck:
            fam = ck.family
            shape = (preset.family, preset.num_hidden_layers, preset.num_local_experts, preset.hidden_size, quant or "dense")
            if (fam.model_type, fam.num_layers, fam.num_experts, fam.hidden, fam.expert_format) == shape:
                log(f"reusing the checkpoint in {path}")
                return {"path": str(path), "written": False}
            log(f"{path} holds another model; rewriting it")
    except PdflashError as exc:
        log(f"writing the {preset.name} {quant or 'bf16'} checkpoint into {path} ({exc})")
    t0 = time.perf_counter()
    write_checkpoint(path, preset, quant=quant, seed=seed, progress=sys.stderr.isatty())
    return {"path": str(path), "written": True, "write_seconds": time.perf_counter() - t0}


# -- link ------------------------------------------------------------------------------------------
def cuda_time(fn, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return times


def copy_gbps(nbytes: int, repeat: int) -> float:
    """Median pinned host -> device bandwidth of one plain PyTorch copy of nbytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)  # warm-up
    times = sorted(cuda_time(lambda: dst.copy_(src, non_blocking=True), repeat))
    return nbytes / times[len(times) // 2] / 1e9


def pinned_bandwidth(expert_bytes: int) -> dict:
    return {"torch_1GiB_gbps": copy_gbps(1 << 30, 5), "torch_expert_gbps": copy_gbps(expert_bytes, 50)}


# -- decode ----------------------------------------------------------------------------------------
def prompt_ids(vocab_limit: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_limit, (n,), generator=g).tolist()


def _pick(logits) -> tuple[int, float]:
    """Greedy token and its margin over the runner-up logit (one device-to-host copy)."""
    flat = logits.reshape(-1).float()
    a, b, tok = torch.cat([flat.topk(2).values, flat.argmax().float()[None]]).tolist()  # argmax: lowest id on a tie
    return int(tok), a - b


def decode_run(step_prefill, step_decode, ids: list[int], warmup: int, tokens: int, snapshot=None) -> dict:
    """Prefill, ``warmup`` tokens, then ``tokens`` measured tokens; stats snapshots around the window.

    Every step records the greedy token and its top-1 minus top-2 logit margin, so a divergence
    between two runs can be told apart from rounding: a near-tie flips under any change of order."""
    sync()
    t0 = time.perf_counter()
    tok, m = _pick(step_prefill(ids))
    ttft = time.perf_counter() - t0
    out, margins = [tok], [m]
    for _ in range(warmup):
        tok, m = _pick(step_decode(tok))
        out.append(tok), margins.append(m)
    before = snapshot() if snapshot else None
    sync()
    t1 = time.perf_counter()
    for _ in range(tokens):
        tok, m = _pick(step_decode(tok))
        out.append(tok), margins.append(m)
    sync()
    dt = time.perf_counter() - t1
    after = snapshot() if snapshot else None
    return {"ttft_ms": ttft * 1e3, "seconds": dt, "tokens": tokens, "tpot_ms": dt / tokens * 1e3,
            "tokens_per_second": tokens / dt, "token_ids": out, "margins": margins, "before": before, "after": after}


def pdflash_snapshot(rt):
    def snap() -> dict:
        st = rt.stats()
        return {
            "exposed": st["exposed_fetch_seconds"] or 0.0,
            "exposed_by_band": dict(st["exposed_fetch_by_band"] or {}),
            "bytes": st["bytes_moved"],
            "hits": st["cache"]["hits"],
            "misses": st["cache"]["misses"],
            "promoted": st["cache"]["promoted"],
            "link_busy": st["link_busy_seconds"],
            "prefetch_used": st["prefetch"]["used"],
            "prefetch_wasted": st["prefetch"]["wasted"],
            "prefetch_issued": sum(st["prefetch"]["issued"].values()),
        }

    return snap


def pdflash_decode(rt, ids, warmup, tokens, graphs: bool = False) -> dict:
    if graphs:  # each layer's non-expert part replayed as a CUDA graph (offload/graphs.py)
        from pdflash.offload.graphs import GraphedDecoder

        dec = GraphedDecoder(rt, max_len=len(ids) + warmup + tokens + 1, graphs=True)
        dec.prepare(len(ids))
        step_prefill, step_decode = dec.prefill, dec.decode
    else:
        kv = rt.new_kv_cache()
        step_prefill = lambda p: prefill(rt, torch.tensor([p]), kv)  # noqa: E731
        step_decode = lambda t: decode_one_token(rt, t, kv)  # noqa: E731
    r = decode_run(step_prefill, step_decode, ids, warmup, tokens, pdflash_snapshot(rt))
    b, a = r.pop("before"), r.pop("after")
    n = r["tokens"]
    d = {k: a[k] - b[k] for k in ("exposed", "bytes", "hits", "misses", "promoted", "link_busy",
                                  "prefetch_used", "prefetch_wasted", "prefetch_issued")}
    r.update(
        exposed_fetch_ms_per_token=d["exposed"] / n * 1e3,
        exposed_fetch_ms_per_token_by_band={k: (a["exposed_by_band"].get(k, 0.0) - b["exposed_by_band"].get(k, 0.0)) / n * 1e3
                                            for k in a["exposed_by_band"]},
        bytes_per_token=d["bytes"] / n,
        hit_rate=d["hits"] / (d["hits"] + d["misses"]) if d["hits"] + d["misses"] else None,
        promoted=d["promoted"],
        link_busy_share=d["link_busy"] / r["seconds"],
        prefetch={"issued": d["prefetch_issued"], "used": d["prefetch_used"], "wasted": d["prefetch_wasted"]},
    )
    return r


# -- runs ------------------------------------------------------------------------------------------
def run_resident(ckpt, ids, args, result: dict) -> None:
    t0 = time.perf_counter()
    with OffloadedModel.load(ckpt, device=DEVICE, link_gbps=args.link_gbps, dtype=args.dtype) as rt:
        result["resident_load_seconds"] = time.perf_counter() - t0
        expert_bytes = rt.cache.slot_bytes
        result["expert_bytes"] = expert_bytes
        if DEVICE.startswith("cuda"):
            result["link"] = pinned_bandwidth(expert_bytes)
            result["link"]["bound_gbps"] = result["link"]["torch_1GiB_gbps"]
        else:  # the simulated link is the bound
            result["link"] = {"bound_gbps": args.link_gbps}
        sync()
        t1 = time.perf_counter()
        n = rt.preload(zero_stats=False)  # every expert through the scheduler, once
        dt = time.perf_counter() - t1
        result["link"]["scheduler_preload_gbps"] = n * expert_bytes / dt / 1e9
        result["link"]["scheduler_preload_experts"] = n
        rt.scheduler.reset()
        rt.cache.zero_stats()
        log(f"link: {json.dumps(result['link'])}")
        for graphs in (False, True) if args.cuda_graphs else (False,):
            rt.cache.zero_stats()
            r = pdflash_decode(rt, ids, args.warmup, args.tokens, graphs)
            name = "pdflash-resident" + ("-graphs" if graphs else "")
            r.update(name=name, cache_slots=rt.cache.capacity, cache_fraction=1.0)
            result["runs"].append(r)
            log(f"{name}: {r['tokens_per_second']:.1f} tok/s, {r['tpot_ms']:.2f} ms/token, exposed {r['exposed_fetch_ms_per_token']:.3f} ms/token")


def run_offload(ckpt, ids, args, result: dict) -> None:
    total = args.preset.num_hidden_layers * args.preset.num_local_experts
    slots = max(args.preset.num_experts_per_tok, round(args.cache_fraction * total))
    copy_configs = [(c, w) for c in args.chunk_mib for w in args.workers]
    for chunk_mib, workers in copy_configs:  # one load per copy configuration (the scheduler is built at load)
        t0 = time.perf_counter()
        with OffloadedModel.load(ckpt, device=DEVICE, expert_cache_experts=slots, eviction=args.eviction,
                                 link_gbps=args.link_gbps, dtype=args.dtype, chunk_mib=chunk_mib, workers=workers) as rt:
            result["offload_load_seconds"] = time.perf_counter() - t0
            for depth, graphs in [(d, g) for d in args.lookahead for g in ((False, True) if args.cuda_graphs else (False,))]:
                rt.reset_cache()  # cold cache, zero statistics; not terminal
                rt.prefetcher.lookahead_depth = depth
                if DEVICE.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                r = pdflash_decode(rt, ids, args.warmup, args.tokens, graphs)
                if DEVICE.startswith("cuda"):  # the VRAM budget this run needed (a peer's --n-cpu-moe is sized to it)
                    free, total = torch.cuda.mem_get_info()
                    r.update(gpu_peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                             gpu_reserved_bytes=torch.cuda.memory_reserved(), gpu_device_used_bytes=total - free)
                name = (f"pdflash-offload-{round(args.cache_fraction * 100)}pct" + (f"-lookahead{depth}" if depth else "")
                        + (f"-chunk{chunk_mib:g}m-w{workers}" if len(copy_configs) > 1 else "")
                        + ("-graphs" if graphs else ""))
                r.update(name=name, cache_slots=slots, cache_fraction=slots / total, lookahead_depth=depth,
                         eviction=args.eviction, chunk_mib=chunk_mib, workers=workers)
                result["runs"].append(r)
                log(f"{name}: {r['tokens_per_second']:.1f} tok/s, {r['tpot_ms']:.2f} ms/token, exposed "
                    f"{r['exposed_fetch_ms_per_token']:.2f} ms/token, {r['bytes_per_token'] / 1e6:.0f} MB/token, "
                    f"hit rate {r['hit_rate']:.2f}, link busy {r['link_busy_share']:.2f}")


def _transformers_model(ckpt, want: torch.dtype):
    """transformers' model of ``ckpt`` with every weight on the device (see the module docstring)."""
    from pdflash.bench.peers import load_transformers_reference
    from pdflash.offload.checkpoint import Checkpoint

    if isinstance(ckpt, Path):  # transformers loads the directory itself
        with Checkpoint(ckpt) as ck:
            fam = ck.family
        model = fam.library_class().from_pretrained(ckpt, dtype=want, device_map=DEVICE, **fam.reference_load_kwargs())
        model.eval()
        for t in list(model.parameters()) + list(model.buffers()):  # dequantized experts may stay bf16
            if t.is_floating_point() and t.dtype != want and t.dtype != torch.float32:
                t.data = t.data.to(want)
        return model
    return load_transformers_reference(ckpt, DEVICE, want, attn_implementation=ckpt.family.reference_attn_implementation)


def run_transformers(ckpt, ids, args, result: dict) -> None:
    from transformers import DynamicCache

    want = getattr(torch, args.dtype or "bfloat16")
    t0 = time.perf_counter()
    model = _transformers_model(ckpt, want)
    load_s = time.perf_counter() - t0
    import inspect

    experts = model.model.layers[0].mlp.experts
    info = {"model_class": type(model).__name__, "experts_dtype": str(getattr(experts, "gate_up_proj").dtype), "experts_implementation":
            getattr(model.config, "_experts_implementation", None), "attn_implementation": model.config._attn_implementation}
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    kv = DynamicCache(config=model.config)

    def step(x):
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([x], device=DEVICE), use_cache=True, logits_to_keep=1, **{kw: kv})
        return out.logits[:, -1, :]

    r = decode_run(lambda p: step(p), lambda t: step([t]), ids, args.warmup, args.tokens)
    r.pop("before"), r.pop("after")
    r.update(name=TF_RUN, load_seconds=load_s, **info)
    result["runs"].append(r)
    log(f"transformers: {r['tokens_per_second']:.1f} tok/s, {r['tpot_ms']:.2f} ms/token ({info})")


def agreement(run: dict, ref: dict, ref_name: str) -> dict:
    """Greedy tokens of ``run`` against ``ref``: the equal prefix and, where they part, both margins there.

    After the first difference the two continue from different tokens, so only the prefix counts."""
    a, b = run["token_ids"], ref["token_ids"]
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    out = {f"greedy_prefix_equal_to_{ref_name}": f"{n if first is None else first}/{n}"}
    if first is not None and "margins" in run and "margins" in ref:
        out[f"{ref_name}_margin_at_divergence"] = ref["margins"][first]
        out[f"margin_at_divergence_vs_{ref_name}"] = run["margins"][first]
    return out


def summarise(result: dict) -> dict:
    runs = {r["name"]: r for r in result["runs"]}
    tf = runs.get(TF_RUN)
    bw = result.get("link", {}).get("bound_gbps")
    summary = {}
    for name, r in runs.items():
        s = {"tokens_per_second": r["tokens_per_second"], "tpot_ms": r["tpot_ms"]}
        resident = runs.get("pdflash-resident-graphs" if name.endswith("-graphs") else "pdflash-resident")  # same step kind
        if "bytes_per_token" in r and resident and bw:
            bound_ms = r["bytes_per_token"] / (bw * 1e9) * 1e3 + resident["tpot_ms"]
            s.update(bound_tpot_ms=bound_ms, utilisation_of_bound=bound_ms / r["tpot_ms"],
                     exposed_fetch_ms_per_token=r["exposed_fetch_ms_per_token"], bytes_per_token=r["bytes_per_token"],
                     meets_85pct_of_bound=bound_ms / r["tpot_ms"] >= 0.85)
        if tf and name != tf["name"]:
            s["speedup_vs_transformers"] = r["tokens_per_second"] / tf["tokens_per_second"]
            s["beats_transformers"] = r["tokens_per_second"] > tf["tokens_per_second"]
        if tf and name != tf["name"]:
            s.update(agreement(r, tf, "transformers"))
        base = runs.get("pdflash-resident")
        if base and name.startswith("pdflash") and name != base["name"]:
            s.update(agreement(r, base, "pdflash_resident"))
        summary[name] = s
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint-dir", type=Path, default=None, help="Where the synthetic checkpoint is (or is written).")
    ap.add_argument("--in-memory", action="store_true", help="Generate the synthetic weights in host memory instead (no checkpoint directory).")
    ap.add_argument("--quant", choices=["auto", "none", "mxfp4", "fp8"], default="auto",
                    help="Expert format: auto is mxfp4 for gpt-oss presets and none (bf16) for Qwen3-MoE ones; fp8: Qwen3-MoE FP8.")
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write the results to.")
    ap.add_argument("--seed", type=int, default=0, help="Seed of the synthetic weights and of the prompt.")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="Prompt length in tokens.")
    ap.add_argument("--warmup", type=int, default=8, help="Decode tokens before the measured window.")
    ap.add_argument("--tokens", type=int, default=64, help="Measured decode tokens per run.")
    ap.add_argument("--cache-fraction", type=float, default=0.25, help="Share of all experts the offload cache holds.")
    ap.add_argument("--lookahead", type=int, nargs="+", default=[0, 1], help="Lookahead depths to run offloaded (0: no prefetch).")
    ap.add_argument("--eviction", default=DEFAULT_EVICTION, help="Eviction policy of the offloaded runs.")
    ap.add_argument("--chunk-mib", type=float, nargs="+", default=[4.0],
                    help="Scheduler chunk size(s) of the offloaded runs; several values sweep (one load each).")
    ap.add_argument("--workers", type=int, nargs="+", default=[2], help="Scheduler copy thread count(s) of the offloaded runs.")
    ap.add_argument("--skip-transformers", action="store_true", help="Do not run the transformers reference.")
    ap.add_argument("--skip-resident", action="store_true", help="Do not run pdflash with every expert on the GPU "
                    "(the link bound then is not computed).")
    ap.add_argument("--cuda-graphs", action="store_true", help="Also run every pdflash configuration with CUDA graphs (offload/graphs.py).")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="Compute dtype of every run (default: the checkpoint's, bf16). float32 removes bf16 rounding "
                         "differences, so greedy tokens can be compared across implementations.")
    ap.add_argument("--preset", default="gpt-oss-20b",
                    help="Synthetic model shape: gpt-oss-20b, qwen3-30b-a3b, qwen3-coder-30b-a3b (tiny / qwen3-tiny: a quick CPU check of this script).")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a check of this script).")
    ap.add_argument("--link-gbps", type=float, default=None, help="CPU only: simulated link speed in GB/s.")
    args = ap.parse_args()
    global DEVICE, TF_RUN
    DEVICE = args.device
    TF_RUN = "transformers-resident-" + {"float32": "float32"}.get(args.dtype, "bf16")
    args.preset = ModelPreset.from_name(args.preset)
    if (args.checkpoint_dir is None) == (not args.in_memory):
        print("Error: give --checkpoint-dir DIR or --in-memory (one of them)", file=sys.stderr)
        return 1
    quant = {"auto": (args.preset.quant_formats or (None,))[0] if args.preset.family == "gpt_oss" else None,
             "none": None}.get(args.quant, args.quant)
    if quant is not None and quant not in args.preset.quant_formats:
        print(f"Error: preset {args.preset.name} has no {quant} format", file=sys.stderr)
        return 1
    args.quant = quant or "none"
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        print("Error: this benchmark needs a CUDA GPU (or --device cpu --preset tiny to check the script)", file=sys.stderr)
        return 1
    if args.cuda_graphs and not DEVICE.startswith("cuda"):
        print("Error: --cuda-graphs needs --device cuda", file=sys.stderr)
        return 1
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("{}")
    except OSError as exc:
        print(f"Error: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    t_start = time.perf_counter()
    config = dict(vars(args), checkpoint_dir=str(args.checkpoint_dir), out=str(args.out), preset=args.preset.name)
    result = {"benchmark": "offload-gpu", "command": " ".join(sys.argv), "config": config, "machine": machine_info(DEVICE), "runs": [],
              "family": args.preset.family, "experts": quant or "bf16", "synthetic_in_memory": args.in_memory}
    if args.in_memory:  # generated once, read by every stage's load
        source = SyntheticCheckpoint(args.preset, quant=quant, seed=args.seed)
        result["checkpoint"] = {"synthetic_in_memory": True, "preset": args.preset.name, "bytes": source.nbytes}
    else:
        source = args.checkpoint_dir
        result["checkpoint"] = ensure_checkpoint(args.checkpoint_dir, args.preset, quant, args.seed)
    ids = prompt_ids(min(1000, args.preset.tokenizer_vocab - 8), args.prompt_tokens, args.seed)
    result["prompt_ids"] = ids
    stages = ([] if args.skip_resident else [("resident", run_resident)]) + [("offload", run_offload)]
    if not args.skip_transformers:
        stages.append(("transformers", run_transformers))
    for name, fn in stages:
        try:
            t0 = time.perf_counter()
            fn(source, ids, args, result)
            result.setdefault("stage_seconds", {})[name] = time.perf_counter() - t0
        except Exception as exc:  # record and go on: the other stages still measure something
            result.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            log(f"{name} failed: {exc}")
        torch.cuda.empty_cache()
        args.out.write_text(json.dumps(result, indent=1, default=str))
    if args.in_memory:
        source.close()
    result["summary"] = summarise(result)
    result["wall_seconds"] = time.perf_counter() - t_start
    args.out.write_text(json.dumps(result, indent=1, default=str))
    for name, s in result["summary"].items():
        log(f"{name}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) and math.isfinite(v) else f"{k}={v}" for k, v in s.items()))
    log(f"wrote {args.out} in {result['wall_seconds']:.0f} s")
    return 0 if not result.get("errors") else 3


if __name__ == "__main__":
    sys.exit(main())
