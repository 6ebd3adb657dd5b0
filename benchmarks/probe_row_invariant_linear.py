"""Do a decode step's dense products round a row alike whatever the step's row count, and what does
a row count cost them? The question behind oracle mode's fixed rows in bf16.

Speculation's oracle mode in a 16-bit dtype runs every step with the draft's trained block of rows
(offload/graphs.py, fixed rows), plain steps too, so that a position rounds alike in any verify
block; in session 33 those plain steps cost 1.11-1.17x a plain arm's step on an H100 machine
(docs/benchmarks.md). The fused parts of a gpt-oss step (attention, norms, experts) compute each
row alone; the dense products do not: q / k / v / o, the router and the head are ``nn.Linear``
(cuBLAS), whose kernel, and with it a row's summation order, depends on the row count. This probe
takes those products at the shapes of a preset, for row counts ``--rows``:

  torch    ``torch.nn.functional.linear`` (cuBLAS on CUDA): the median time (CUDA events, ``--iters`` calls; wall
           clock elsewhere), and whether each row of an M-row product has the bits of the same
           row computed alone (``invariant``);
  rows     a Triton kernel written here whose programs always hold 16 rows (the real ones, the
           rest masked) and sum over the inputs in one fixed order, so that a row's result
           cannot depend on the other rows: the same time, its invariance, and its largest
           difference from cuBLAS relative to the largest output.

The summary prices a step's dense products (every layer's five, then the head) at each row
count, per implementation: what fixed rows cost against one row, and what a row-invariant
kernel would cost instead. Nothing here is part of pdflash's runtime; it decides whether
row-invariant dense products could replace the padding.

    python3 benchmarks/probe_row_invariant_linear.py --out $OUT/row_invariant_linear.json
    # anywhere (Triton's interpreter on the CPU, reduced shapes, seconds):
    TRITON_INTERPRET=1 python benchmarks/probe_row_invariant_linear.py --device cpu --dtype float32 \\
        --scale 64 --rows 1,3 --iters 2 --out /tmp/ril.json
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

from bench_offload_gpu import cuda_time  # noqa: E402

BLOCK_M = 16  # rows a program holds: every product of up to 16 rows runs the same instructions


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rows_linear(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + rn[None, :] * swn + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
            acc += tl.dot(a, w)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    return triton, rows_linear


def rows_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, block_n: int = 64, block_k: int = 64):
    """x [M, K] (M <= 16) @ w[N, K].T + b, each row summed alone in one fixed order."""
    triton, kern = _kernel()
    M, K = x.shape
    N = w.shape[0]
    if M > BLOCK_M:
        raise ValueError(f"at most {BLOCK_M} rows, got {M}")
    x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    kern[(triton.cdiv(N, block_n),)](x, w, b if b is not None else w, y, M, N, K, x.stride(0), w.stride(0),
                                     y.stride(0), HAS_BIAS=b is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
                                     BLOCK_K=block_k)
    return y


def shapes(preset: str, scale: int) -> dict[str, tuple[int, int, bool]]:
    """name -> (in, out, bias) of a step's dense products, the preset's sizes divided by ``scale``."""
    from pdflash.offload.config import ModelPreset

    p = ModelPreset.from_name(preset)
    H, hd = p.hidden_size // scale, p.head_dim
    q, kv = max(1, p.num_attention_heads // scale) * hd, max(1, p.num_key_value_heads // scale) * hd
    return {"q": (H, q, True), "k": (H, kv, True), "v": (H, kv, True), "o": (q, H, True),
            "router": (H, p.num_local_experts, True), "head": (H, max(64, p.vocab_size // scale), False)}


def timed(fn, iters: int, cuda: bool) -> float:
    """Median seconds of fn() over iters calls (after one warm-up): CUDA events on CUDA
    (bench_offload_gpu.cuda_time), the wall clock elsewhere."""
    fn()
    if cuda:
        return statistics.median(cuda_time(fn, iters))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def invariant(fn, x: torch.Tensor) -> bool:
    """Whether every row of fn(x) has the bits of fn(that row alone)."""
    full = fn(x)
    return all(torch.equal(full[i], fn(x[i:i + 1])[0]) for i in range(x.shape[0]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", default="1,2,4,8", help="comma-separated row counts, 1..16")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--scale", type=int, default=1, help="divide the preset's sizes by this (CPU checks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        rows = sorted({int(r) for r in args.rows.split(",") if r.strip()})
    except ValueError:
        rows = []
    if not rows or not all(1 <= r <= BLOCK_M for r in rows):
        ap.error(f"--rows takes comma-separated counts in 1..{BLOCK_M}, got {args.rows!r}")
    if args.iters < 1 or args.scale < 1:
        ap.error("--iters and --scale must be at least 1")
    from pdflash.offload.config import ModelPreset

    try:
        sh = shapes(args.preset, args.scale)
        layers = ModelPreset.from_name(args.preset).num_hidden_layers
    except Exception as e:  # an unknown preset
        ap.error(str(e))
    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    cuda = dev.type == "cuda"
    g = torch.Generator().manual_seed(args.seed)
    results: dict[str, dict] = {}
    for name, (K, N, bias) in sh.items():
        w = (torch.randn(N, K, generator=g) / K**0.5).to(dt).to(dev)
        b = torch.randn(N, generator=g).to(dt).to(dev) if bias else None
        per = {}
        for M in rows:
            x = torch.randn(M, K, generator=g).to(dt).to(dev)
            lib = lambda x=x: torch.nn.functional.linear(x, w, b)  # noqa: E731
            own = lambda x=x: rows_linear(x, w, b)  # noqa: E731
            ref, mine = lib(), own()
            per[M] = {"torch_us": 1e6 * timed(lib, args.iters, cuda), "rows_us": 1e6 * timed(own, args.iters, cuda),
                      "torch_invariant": invariant(lambda t: torch.nn.functional.linear(t, w, b), x),
                      "rows_invariant": invariant(lambda t: rows_linear(t, w, b), x),
                      "rows_vs_torch": float((mine.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))}
        results[name] = {"in": K, "out": N, "bias": bias, "rows": per}
        print(f"{name:>6} {K}x{N}: " + ", ".join(
            f"M={M} torch {v['torch_us']:.1f} us{'' if v['torch_invariant'] else ' (varies)'} / rows {v['rows_us']:.1f} us"
            f"{'' if v['rows_invariant'] else ' (VARIES)'}" for M, v in per.items()), file=sys.stderr)
    step = {}
    for M in rows:
        per_layer = {impl: sum(results[n]["rows"][M][f"{impl}_us"] for n in ("q", "k", "v", "o", "router"))
                     for impl in ("torch", "rows")}
        step[M] = {impl: layers * per_layer[impl] + results["head"]["rows"][M][f"{impl}_us"] for impl in per_layer}
    summary = {"step_dense_us": step,
               "torch_invariant_everywhere": all(v["torch_invariant"] for r in results.values() for v in r["rows"].values()),
               "rows_invariant_everywhere": all(v["rows_invariant"] for r in results.values() for v in r["rows"].values())}
    for M, s in step.items():
        print(f"a step's dense products at {M} rows: torch {s['torch']:.0f} us, rows kernel {s['rows']:.0f} us",
              file=sys.stderr)
    out = {"preset": args.preset, "scale": args.scale, "device": str(dev), "dtype": args.dtype, "layers": layers,
           "gpu": torch.cuda.get_device_name(dev) if cuda else None, "torch": torch.__version__,
           "products": results, "summary": summary}
    args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
