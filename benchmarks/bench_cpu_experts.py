"""Benchmark of the native CPU expert kernel (native/pf_cpu.c) against the machine's DRAM read bandwidth.

    python benchmarks/bench_cpu_experts.py --out cpu_experts.json          # gpt-oss-20b shape (GPU host)
    python benchmarks/bench_cpu_experts.py --small --threads 1,2 --json    # a quick run on a small CPU

Workload: ``--experts`` (40) distinct experts of the gpt-oss-20b shape (hidden 2880,
intermediate 2880: gate_up 2880 -> 5760, down 2880 -> 2880) in MXFP4 (blocks + E8M0 scales +
bf16 biases, 13.2 MB each), packed one after another in one host buffer as the host store
holds them; the calls cycle through the experts so every call reads its weights from DRAM
(40 x 13 MB is far larger than any L3). For each thread count (``--threads``, 8,16) and
token count (``--tokens``, 1,8,16):

  dram      streaming read of the whole expert buffer by the kernel's own thread pool
            (pf_cpu_stream_read: 64 KiB grabs claimed by the threads, the widest loads of the
            level), best of ``--repeats``: the read bandwidth available to those threads.
  kernel    pf_cpu_expert over the experts in turn, float32 and bf16 inputs; effective
            bandwidth = weight bytes read / seconds per call (median over the calls), and
            its ratio to ``dram`` of the same thread count (the aim: >= 70 % at 16 threads
            for one token).
  layer     one batched call (pf_cpu_experts) over ``--layer`` experts (4, 8) with 1 and 4
            token rows each: a layer's CPU share in hybrid execution, one pool hand-off per phase.
  torch     PyTorch's bf16 path for the same expert maths on the same thread count
            (torch.set_num_threads): weights already dequantized to bf16 (``--torch-experts``
            distinct ones, 8 by default, 50 MB each), ``x @ W1 + b1 -> SwiGLU -> @ W2 + b2``; its
            effective bandwidth counts the bf16 bytes it reads, and its time per expert is
            comparable with the kernel's directly.

With ``--model DIR`` (a checkpoint; ``embedded`` for the embedded model) it measures instead
generation on the CPU device with ``--cpu-experts off`` (today's path: dequantize, then one
matmul per expert) and ``all`` (the native kernel), alternating ``--repeats`` times: decode
tokens per second and the wall time spent inside the experts modules per generated token,
and whether both produced the same tokens.

Every figure is measured in the same run on the same machine; nothing is assumed. JSON goes
to stdout with ``--json`` or to ``--out FILE``; a table is printed otherwise.
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

from pdflash.machine import machine_info  # noqa: E402
from pdflash.native.cpu_experts import CpuExperts, ExpertWeights, detect_level  # noqa: E402
from pdflash.offload.gpt_oss import mxfp4_expert_layout  # noqa: E402

ALPHA, LIMIT = 1.702, 7.0


def make_experts(n: int, hidden: int, inter: int, seed: int):
    """n MXFP4 experts packed in one uint8 buffer (the host store's row layout) and their ExpertWeights."""
    layout = mxfp4_expert_layout(hidden, inter)
    buf = torch.empty((n, layout.expert_bytes), dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    for p in layout.pieces:
        view = layout.view(buf, p.name)
        if p.name.endswith("_blocks"):
            view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=g))
        elif p.name.endswith("_scales"):  # typical trained scales: 2^-8 .. 2^0
            view.copy_(torch.randint(119, 128, view.shape, dtype=torch.uint8, generator=g))
        else:
            view.copy_((torch.randn(view.shape, generator=g) * 0.1).to(view.dtype))
    return layout, buf, expert_weights(layout, buf)


def expert_weights(layout, buf: torch.Tensor, round_bf16: bool = False) -> list:
    """ExpertWeights viewing each packed row of ``buf`` (no copy). ``round_bf16``: as a bfloat16
    model's experts (h rounded to bf16, so down runs bf16 kernels too)."""
    out = []
    for i in range(buf.shape[0]):
        v = lambda name, i=i: layout.view(buf[i], name)  # noqa: E731
        out.append(ExpertWeights.mxfp4(v("gate_up_proj_blocks"), v("gate_up_proj_scales"), v("gate_up_proj_bias"),
                                       v("down_proj_blocks"), v("down_proj_scales"), v("down_proj_bias"),
                                       alpha=ALPHA, limit=LIMIT, round_bf16=round_bf16))
    return out


def bench_dram(k: CpuExperts, buf: torch.Tensor, repeats: int) -> dict:
    k.stream_read(buf)  # first touch
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        k.stream_read(buf)
        times.append(time.perf_counter() - t0)
    nbytes = buf.numel()
    return {"bytes": nbytes, "best_s": min(times), "gbps": nbytes / min(times) / 1e9,
            "median_gbps": nbytes / statistics.median(times) / 1e9}


def phase_split(timings: list[dict]) -> dict:
    """Medians over calls of where a call's time went (pf_cpu_last_timing), in microseconds:
    start (to the first published phase: the caller's own token-row preparation), join (the
    last thread's first claim in gate_up, after its publication: how long waking the pool
    takes), gate_up and down (publication to last grab done), handoff (gate_up done to down
    published), back (down done to the caller's return), threads (that took part in gate_up)."""
    parts: dict[str, list[float]] = {k: [] for k in ("start", "join", "gate_up", "handoff", "down", "back", "threads")}
    for t in timings:
        gu, dn = t["phases"].get("gate_up"), t["phases"].get("down")
        if not gu or not dn:
            continue
        parts["start"].append(gu["published_us"])
        parts["join"].append(gu["last_join_us"] - gu["published_us"])
        parts["gate_up"].append(gu["completed_us"] - gu["published_us"])
        parts["handoff"].append(dn["published_us"] - gu["completed_us"])
        parts["down"].append(dn["completed_us"] - dn["published_us"])
        parts["back"].append(t["end_us"] - dn["completed_us"])
        parts["threads"].append(gu["threads"])
    return {f"{k}_us" if k != "threads" else k: round(statistics.median(v), 2) for k, v in parts.items() if v}


def _pool_text(pool: dict) -> str:
    return ", ".join(f"{k[:-3]} {v:.1f} us" for k, v in pool.items() if k.endswith("_us")) + (
        f", {pool['threads']:.0f} threads in gate_up" if "threads" in pool else "")


def bench_kernel(k: CpuExperts, weights, tokens: int, dtype: torch.dtype, calls: int, hidden: int,
                 model: str = "float32", prewake_us: int = 0, lead_us: float = 200.0) -> dict:
    """One expert per call, back to back. ``prewake_us``: as the runtime calls the kernel (it
    wakes the pool while a layer's routing reaches the host), ``lead_us`` before each timed call
    the pool is woken to poll for up to that long; 0: its threads sleep between calls."""
    x = torch.randn(tokens, hidden).to(dtype)
    out = torch.empty(tokens, hidden)
    n = len(weights)
    for i in range(min(n, 4)):  # warm-up (scratch buffers, page faults of out)
        k.forward(weights[i], x, out=out)
    times, timings = [], []
    for i in range(calls):
        w = weights[i % n]
        if prewake_us:
            k.prewake(prewake_us)
            _busy(lead_us)
        t0 = time.perf_counter()
        k.forward(w, x, out=out)
        times.append(time.perf_counter() - t0)
        timings.append(k.last_timing())
    med = statistics.median(times)
    nbytes = weights[0].nbytes
    return {"tokens": tokens, "x_dtype": str(dtype).replace("torch.", ""), "model": model, "calls": calls,
            "prewake_us": prewake_us, "lead_us": lead_us if prewake_us else 0.0,
            "weight_bytes": nbytes, "median_ms": med * 1e3, "best_ms": min(times) * 1e3,
            "gbps": nbytes / med / 1e9, "best_gbps": nbytes / min(times) / 1e9, "pool": phase_split(timings)}


def _busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def bench_layer(k: CpuExperts, weights, per_call: int, tokens: int, calls: int, hidden: int,
                gap_us: float = 0.0, prewake_us: int = 0, lead_us: float = 200.0) -> dict:
    """One batched call (pf_cpu_experts) over ``per_call`` experts, ``tokens`` token rows each,
    as a layer hands its CPU share to the kernel: effective bandwidth = their weight bytes / time.
    ``gap_us``: the caller busy for that long before each call (as decoding is between two
    layers' calls, while the device runs attention), the pool's threads left idle meanwhile.
    ``prewake_us``: ``lead_us`` before each call (as the routing copy starts before a layer's
    call), the pool is woken to poll for up to that long (``CpuExperts.prewake``)."""
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    rows = torch.arange(tokens, dtype=torch.int32).repeat(per_call)
    dest = torch.arange(per_call * tokens, dtype=torch.int32)
    scale = torch.rand(per_call * tokens)
    out = torch.empty(per_call * tokens, hidden)
    n = len(weights)
    k.forward_many(weights[:per_call], [tokens] * per_call, rows, dest, x, out, scale)  # warm-up
    times, timings = [], []
    for i in range(calls):
        ws = [weights[(i * per_call + j) % n] for j in range(per_call)]
        if gap_us > 0:
            lead = min(lead_us, gap_us) if prewake_us else 0.0
            _busy(gap_us - lead)
            if prewake_us:
                k.prewake(prewake_us)
                _busy(lead)
        t0 = time.perf_counter()
        k.forward_many(ws, [tokens] * per_call, rows, dest, x, out, scale)
        times.append(time.perf_counter() - t0)
        timings.append(k.last_timing())
    med = statistics.median(times)
    nbytes = weights[0].nbytes * per_call
    return {"experts_per_call": per_call, "tokens": tokens, "calls": calls, "gap_us": gap_us,
            "prewake_us": prewake_us if gap_us > 0 else 0, "lead_us": lead_us if prewake_us and gap_us > 0 else 0,
            "weight_bytes": nbytes,
            "median_ms": med * 1e3, "gbps": nbytes / med / 1e9, "best_gbps": nbytes / min(times) / 1e9,
            "pool": phase_split(timings)}


def bench_torch(threads: int, tokens_list, n_experts: int, hidden: int, inter: int, calls: int, seed: int) -> list[dict]:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    experts = []
    for _ in range(n_experts):
        w1 = (torch.randn(hidden, 2 * inter, generator=g) * 0.02).bfloat16()
        w2 = (torch.randn(inter, hidden, generator=g) * 0.02).bfloat16()
        b1 = torch.zeros(2 * inter, dtype=torch.bfloat16)
        b2 = torch.zeros(hidden, dtype=torch.bfloat16)
        experts.append((w1, b1, w2, b2))
    nbytes = sum(t.numel() * t.element_size() for t in experts[0])

    def expert(x, w1, b1, w2, b2):
        gu = x @ w1 + b1
        gate, up = gu[..., ::2].clamp(max=LIMIT), gu[..., 1::2].clamp(-LIMIT, LIMIT)
        return ((up + 1) * gate * torch.sigmoid(gate * ALPHA)) @ w2 + b2

    rows = []
    with torch.inference_mode():
        for tokens in tokens_list:
            x = torch.randn(tokens, hidden).bfloat16()
            for e in experts[:2]:
                expert(x, *e)
            times = []
            for i in range(calls):
                t0 = time.perf_counter()
                expert(x, *experts[i % n_experts])
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            rows.append({"tokens": tokens, "calls": calls, "weight_bytes": nbytes, "median_ms": med * 1e3,
                         "gbps": nbytes / med / 1e9})
    del experts
    return rows


def bench_model(model: str, tokens: int, repeats: int, threads: int | None) -> dict:
    """generate on the CPU device, cpu_experts off vs all, alternating; experts-module time per token."""
    from pdflash.offload.experts import OffloadedExperts
    from pdflash.offload.generate import generate
    from pdflash.offload.runtime import OffloadedModel

    if model == "embedded":
        from pdflash.offload.embedded import embedded_target

        model = str(embedded_target())
    prompt = [5, 77, 200, 31, 9, 100, 250, 17, 3, 44, 81, 90]
    runs = {"off": [], "all": []}
    tokens_of = {}
    for _ in range(repeats):
        for mode in ("off", "all"):
            with OffloadedModel.load(model, device="cpu", cpu_experts=mode, cpu_threads=threads) as rt:
                spent = [0.0]

                def pre(mod, args, kwargs):
                    mod._t0 = time.perf_counter()

                def post(mod, args, kwargs, out):
                    spent[0] += time.perf_counter() - mod._t0

                for m in rt.model.modules():
                    if isinstance(m, OffloadedExperts):
                        m.register_forward_pre_hook(pre, with_kwargs=True)
                        m.register_forward_hook(post, with_kwargs=True)
                vocab = int(rt.config.vocab_size)
                ids = [t % vocab for t in prompt]
                generate(rt, ids, max_new_tokens=2, eos_token_ids=[])  # warm-up
                spent[0] = 0.0
                res = generate(rt, ids, max_new_tokens=tokens, eos_token_ids=[])
                runs[mode].append({"tokens_per_second": res.tokens_per_second,
                                   "experts_ms_per_token": spent[0] / len(res.token_ids) * 1e3,
                                   "level": rt.cpu.level if rt.cpu is not None else None})
                tokens_of[mode] = res.token_ids
    med = lambda xs: statistics.median(xs)  # noqa: E731
    summary = {mode: {"median_tokens_per_second": med([r["tokens_per_second"] for r in rs]),
                      "median_experts_ms_per_token": med([r["experts_ms_per_token"] for r in rs])} for mode, rs in runs.items()}
    return {"model": model, "tokens": tokens, "repeats": repeats, "threads": threads, "runs": runs, "summary": summary,
            "speedup_tokens_per_second": summary["all"]["median_tokens_per_second"] / summary["off"]["median_tokens_per_second"],
            "speedup_experts_time": summary["off"]["median_experts_ms_per_token"] / summary["all"]["median_experts_ms_per_token"],
            "same_tokens": tokens_of["off"] == tokens_of["all"]}


def _numbers(ap, name: str, text: str, kind, lo, hi=None) -> list:
    """A comma-separated option as a list of ``kind`` in lo .. hi, or one clear line and exit 2."""
    try:
        values = [kind(v) for v in text.split(",") if v]
    except ValueError:
        ap.error(f"--{name}: comma-separated {'integers' if kind is int else 'numbers'}, got {text!r}")
    if any(v < lo or (hi is not None and v > hi) for v in values):
        ap.error(f"--{name}: values in {lo} .. {hi if hi is not None else 'any'}, got {text!r}")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="hidden = intermediate = 512 (a quick CPU run)")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--inter", type=int, default=None)
    ap.add_argument("--experts", type=int, default=40, help="distinct MXFP4 experts cycled through")
    ap.add_argument("--threads", default="8,16", help="comma-separated thread counts")
    ap.add_argument("--tokens", default="1,8,16", help="comma-separated token counts (1..16)")
    ap.add_argument("--calls", type=int, default=200, help="timed kernel calls per configuration")
    ap.add_argument("--layer", default="4,8", help="experts per batched call (a layer's CPU share; 0: skip)")
    ap.add_argument("--gaps", default="0", help="comma-separated idle gaps (us) before each layer call")
    ap.add_argument("--prewake", default="0", help="comma-separated prewake polls (us; 0: none) tried with each gap > 0")
    ap.add_argument("--lead", type=float, default=200.0, help="with --prewake: us between the prewake and the call")
    ap.add_argument("--kernel-prewake", type=int, default=0, metavar="US",
                    help="single-expert calls: wake the pool --lead us before each call, polling up to US us, "
                         "as the runtime does (default 0: threads sleep between calls)")
    ap.add_argument("--repeats", type=int, default=5, help="timed streaming reads per thread count")
    ap.add_argument("--level", default=None, help="kernel level (default: the best this CPU runs)")
    ap.add_argument("--torch-experts", type=int, default=8, help="distinct bf16 experts for the PyTorch comparison (0: skip)")
    ap.add_argument("--torch-calls", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="checkpoint dir (or 'embedded'): generation off vs all on the CPU")
    ap.add_argument("--gen-tokens", type=int, default=32, help="with --model: tokens generated per run")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    threads = _numbers(ap, "threads", args.threads, int, 1)
    tokens = _numbers(ap, "tokens", args.tokens, int, 1, 16)
    layers = _numbers(ap, "layer", args.layer, int, 0)
    gaps = _numbers(ap, "gaps", args.gaps, float, 0)
    prewakes = _numbers(ap, "prewake", args.prewake, int, 0, 100_000)
    if not 0 <= args.kernel_prewake <= 100_000:
        ap.error(f"--kernel-prewake: 0 .. 100000 us, got {args.kernel_prewake}")
    if args.lead < 0:
        ap.error(f"--lead: a non-negative number of us, got {args.lead}")

    if args.model:
        threads = threads[0] if args.threads != "8,16" else None
        res = bench_model(args.model, args.gen_tokens, args.repeats, threads)
        text = json.dumps(res, indent=1)
        if args.out:
            args.out.write_text(text + "\n")
        if args.json:
            print(text)
        else:
            for mode, sm in res["summary"].items():
                print(f"{mode:3s}: {sm['median_tokens_per_second']:.2f} tok/s, experts {sm['median_experts_ms_per_token']:.2f} ms/token")
            print(f"speedup: {res['speedup_tokens_per_second']:.2f}x tokens/s, {res['speedup_experts_time']:.2f}x experts time; "
                  f"same tokens: {res['same_tokens']}")
        return 0

    hidden = args.hidden or (512 if args.small else 2880)
    inter = args.inter or (512 if args.small else 2880)
    layout, buf, weights = make_experts(args.experts, hidden, inter, args.seed)
    weights_bf16 = expert_weights(layout, buf, round_bf16=True)  # the same bytes as a bf16 model's

    result = {
        "machine": dict(machine_info(), best_level=detect_level()),
        "shape": {"hidden": hidden, "inter": inter, "experts": args.experts, "expert_bytes": layout.expert_bytes,
                  "weight_bytes": weights[0].nbytes, "buffer_bytes": buf.numel()},
        "runs": [],
    }
    for n in threads:
        with CpuExperts(threads=n, level=args.level) as k:
            dram = bench_dram(k, buf, args.repeats)
            run = {"threads": n, "level": k.level, "dram": dram, "kernel": []}
            for t in tokens:
                for dt, ws, model in ((torch.float32, weights, "float32"), (torch.bfloat16, weights, "float32"),
                                      (torch.bfloat16, weights_bf16, "bfloat16")):
                    r = bench_kernel(k, ws, t, dt, args.calls, hidden, model, args.kernel_prewake, args.lead)
                    r["of_dram"] = r["gbps"] / dram["gbps"]
                    run["kernel"].append(r)
            run["layer"] = []
            for m in [v for v in layers if v > 0]:
                for t in (1, 4):
                    for gap in gaps:
                        for pw in (prewakes if gap > 0 else [0]):
                            r = bench_layer(k, weights, min(m, len(weights)), t, max(10, args.calls // m), hidden, gap,
                                            pw, args.lead)
                            r["of_dram"] = r["gbps"] / dram["gbps"]
                            run["layer"].append(r)
        if args.torch_experts > 0:
            run["torch_bf16"] = bench_torch(n, tokens, args.torch_experts, hidden, inter, args.torch_calls, args.seed)
        result["runs"].append(run)

    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    elif not args.json:
        for run in result["runs"]:
            d = run["dram"]
            print(f"threads {run['threads']} ({run['level']}): DRAM read {d['gbps']:.1f} GB/s (best of {args.repeats})")
            for r in run["kernel"]:
                woke = f" (prewake {r['prewake_us']} us, {r['lead_us']:.0f} us ahead)" if r.get("prewake_us") else ""
                print(f"  kernel T={r['tokens']:2d} x {r['x_dtype']:8s} {r['model']:8s} model{woke}: {r['median_ms']:8.3f} ms/expert  "
                      f"{r['gbps']:6.1f} GB/s  {r['of_dram']:6.1%} of DRAM")
                print(f"    pool: {_pool_text(r.get('pool') or {})}")
            for r in run.get("layer", []):
                gap = f" after {r['gap_us']:.0f} us idle" if r["gap_us"] else ""
                if r.get("prewake_us"):
                    gap += f" (prewake {r['prewake_us']} us, {r['lead_us']:.0f} us ahead)"
                print(f"  layer {r['experts_per_call']:2d} experts x T={r['tokens']:2d}{gap}: {r['median_ms']:8.3f} ms/call  "
                      f"{r['gbps']:6.1f} GB/s  {r['of_dram']:6.1%} of DRAM")
                print(f"    pool: {_pool_text(r.get('pool') or {})}")
            for r in run.get("torch_bf16", []):
                print(f"  torch bf16 T={r['tokens']:2d}: {r['median_ms']:8.3f} ms/expert  {r['gbps']:6.1f} GB/s (bf16 bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
