"""A Qwen3-MoE expert on the CPU: the native kernel (pf_cpu.c's row formats) against the family's
PyTorch kernel, bf16 and FP8, and the PyTorch kernel's FP8 dequantization against PyTorch's own
float8 conversion, in one run.

    python benchmarks/bench_qwen3_cpu.py                     # Qwen3-30B-A3B's expert: H 2048, I 768
    python benchmarks/bench_qwen3_cpu.py --hidden 4096 --inter 1536 --tokens 1,4 --threads 8 --json out.json

Arms, each over ``--experts`` distinct experts (more than the caches hold), for each token count,
x in bf16 and a bf16 model's rounding throughout:
``bf16_native`` / ``fp8_native`` (the native kernel over the stored rows, ``--threads`` threads),
``bf16`` (the PyTorch kernel, bf16 weights: no dequantization), ``fp8`` (``dequantize_fp8`` as
the family's PyTorch kernel runs it on a CPU tensor: this thread's scratch buffers), ``fp8_fresh``
(the same with fresh buffers each call) and ``fp8_torch`` (the same arithmetic with PyTorch's
``w.to(torch.float32)`` and an out-of-place scale). One expert = gate_up [2I, H] and down [H, I],
``(silu(x W1g^T) * x W1u^T) W2^T``. Reported: milliseconds an expert (best of ``--repeats``
passes) and, for the native arms, weight bytes a second against the streaming read of as many
bytes by the same threads (``pf_cpu_stream_read``); the PyTorch FP8 arms must agree bit for bit
and the native arms with them within a few bf16 steps (exit 1 if not). PyTorch's threads:
``torch.get_num_threads()``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import import_pdflash  # noqa: E402

import_pdflash()

from pdflash.native.cpu_experts import CpuExperts, ExpertWeights, default_threads  # noqa: E402
from pdflash.offload.qwen3_moe import dequantize_fp8  # noqa: E402


def torch_dequantize(w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, block: int) -> torch.Tensor:
    R, C = w.shape
    q = w.to(torch.float32).reshape(R // block, block, C // block, block)
    return (q * s.to(torch.float32).reshape(R // block, 1, C // block, 1)).to(dtype).reshape(R, C)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--experts", type=int, default=24)
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="native kernel threads (default: this process's cores)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    H, I, b = a.hidden, a.inter, a.block
    if H % b or I % b or min(H, I, a.experts, a.repeats) < 1:
        print("bench_qwen3_cpu: --hidden and --inter must be positive multiples of --block; --experts and "
              "--repeats at least 1", file=sys.stderr)
        return 2
    tokens = [int(t) for t in a.tokens.split(",")]
    g = torch.Generator().manual_seed(0)
    fp8 = [((torch.randn(2 * I, H, generator=g) * 16).to(torch.float8_e4m3fn),
            torch.rand(2 * I // b, H // b, generator=g) / 64,
            (torch.randn(H, I, generator=g) * 16).to(torch.float8_e4m3fn),
            torch.rand(H // b, I // b, generator=g) / 64) for _ in range(a.experts)]
    bf16 = [(torch.randn(2 * I, H, generator=g, dtype=torch.bfloat16) / 32,
             torch.randn(H, I, generator=g, dtype=torch.bfloat16) / 32) for _ in range(a.experts)]

    def expert(w1, w2, x):
        gate, up = (x @ w1.t()).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ w2.t()

    kernel = CpuExperts(threads=a.threads or default_threads())
    native_fp8 = [ExpertWeights.rows(f[0], f[2], f[1], f[3], round_bf16=True) for f in fp8]
    native_bf16 = [ExpertWeights.rows(*w, round_bf16=True) for w in bf16]
    # the memory's streaming read by the same threads, over as many bytes as the FP8 experts hold
    buf = torch.ones(sum(w.nbytes for w in native_fp8), dtype=torch.uint8)
    dram = 0.0
    for _ in range(a.repeats + 1):
        t0 = time.perf_counter()
        kernel.stream_read(buf)
        dram = max(dram, buf.numel() / (time.perf_counter() - t0) / 1e9)
    del buf

    arms = {
        "bf16_native": lambda e, x: kernel.forward(native_bf16[e], x),
        "fp8_native": lambda e, x: kernel.forward(native_fp8[e], x),
        "bf16": lambda e, x: expert(*bf16[e], x),
        "fp8": lambda e, x: expert(dequantize_fp8(fp8[e][0], fp8[e][1], torch.bfloat16, scratch=True),
                                   dequantize_fp8(fp8[e][2], fp8[e][3], torch.bfloat16, scratch=True), x),
        "fp8_fresh": lambda e, x: expert(dequantize_fp8(fp8[e][0], fp8[e][1], torch.bfloat16),
                                         dequantize_fp8(fp8[e][2], fp8[e][3], torch.bfloat16), x),
        "fp8_torch": lambda e, x: expert(torch_dequantize(fp8[e][0], fp8[e][1], torch.bfloat16, b),
                                         torch_dequantize(fp8[e][2], fp8[e][3], torch.bfloat16, b), x),
    }
    out = {"hidden": H, "inter": I, "block": b, "experts": a.experts, "torch_threads": torch.get_num_threads(),
           "native_threads": kernel.threads, "native_level": kernel.level, "fp8_bytes_per_expert": native_fp8[0].nbytes,
           "bf16_bytes_per_expert": native_bf16[0].nbytes, "dram_read_gbps": dram, "results": []}
    print(f"DRAM read, {kernel.threads} threads: {dram:.1f} GB/s")
    for T in tokens:
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        want = arms["fp8_torch"](0, x)
        same = torch.equal(arms["fp8"](0, x), want) and torch.equal(arms["fp8_fresh"](0, x), want)

        def close(y, ref):  # a few bf16 steps: the native sums run in another order
            ref = ref.float()
            return bool(((y - ref).abs() <= 4 * torch.clamp(ref.abs(), min=2.0**-10) * 2.0**-7 + 1e-6).float().mean() > 0.99)

        native_ok = close(arms["fp8_native"](0, x), want) and close(arms["bf16_native"](0, x), arms["bf16"](0, x))
        row = {"tokens": T, "fp8_arms_identical": same, "native_close": native_ok}
        for name, fn in arms.items():
            best = float("inf")
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                for e in range(a.experts):
                    fn(e, x)
                best = min(best, (time.perf_counter() - t0) / a.experts)
            row[f"{name}_ms"] = best * 1e3
        row["fp8_speedup"] = row["fp8_torch_ms"] / row["fp8_ms"]
        row["fp8_native_speedup"] = row["fp8_ms"] / row["fp8_native_ms"]
        for fmt in ("fp8", "bf16"):  # the native kernel's weight bytes a second, and that against the read
            gbps = out[f"{fmt}_bytes_per_expert"] / (row[f"{fmt}_native_ms"] * 1e-3) / 1e9
            row[f"{fmt}_native_gbps"], row[f"{fmt}_native_of_dram"] = gbps, gbps / dram
        row["bf16_native_speedup"] = row["bf16_ms"] / row["bf16_native_ms"]
        out["results"].append(row)
        print(f"T={T}: native bf16 {row['bf16_native_ms']:.3f} ms, native fp8 {row['fp8_native_ms']:.3f} ms; "
              f"PyTorch bf16 {row['bf16_ms']:.3f} ms, fp8 {row['fp8_ms']:.3f} ms (fresh buffers {row['fp8_fresh_ms']:.3f}, "
              f"PyTorch's float8 conversion {row['fp8_torch_ms']:.3f}); native over PyTorch: bf16 "
              f"{row['bf16_native_speedup']:.2f}x, fp8 {row['fp8_native_speedup']:.2f}x; native of the DRAM read: bf16 "
              f"{row['bf16_native_of_dram']:.0%}, fp8 {row['fp8_native_of_dram']:.0%}; FP8 arms identical: {same}, "
              f"native close: {native_ok}")
    kernel.close()
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(r["fp8_arms_identical"] and r["native_close"] for r in out["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
