"""The fused MXFP4 expert kernels on a GPU: agreement with the generic path, batch invariance, speed.

    python benchmarks/check_fused_gpu.py --out fused_gpu.json

Random expert slots in the gpt-oss-20b shape (hidden 2880, intermediate 2880, MXFP4, bf16
biases), routed to 4 experts per token:

- agreement: contrib rows of the fused kernels against the generic path (dequantize + cuBLAS
  matmul), bf16: share of bit-identical values and largest difference relative to the row scale;
- batch invariance: every pair computed in one launch, one by one, and in uneven waves
  (bit-identical is the claim), for 1 token and for an 8-token verify block;
- speed: one layer's expert maths (CUDA events, median of 50) for 1 and 8 tokens, fused against
  the generic path (weights gathered + dequantized + batched matmul).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pdflash.offload.gpt_oss import GptOssExpertKernel, mxfp4_expert_layout
from pdflash.offload.synthetic import random_mxfp4_slots

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ itself
from bench_offload_gpu import cuda_time  # noqa: E402

H = I = 2880
E, K = 8, 4


def make_slots(dev):
    layout = mxfp4_expert_layout(H, I)
    return layout, random_mxfp4_slots(layout, E, seed=0).to(dev)


def generic(kernel, slots, x, w, idx, T):
    out = torch.empty(T * K, H, dtype=torch.bfloat16, device=x.device)
    flat = idx.view(-1).tolist()
    experts = sorted(set(flat))
    weights = kernel.weights(slots, experts)
    for i, e in enumerate(experts):
        pos = [p for p, f in enumerate(flat) if f == e]
        pt = torch.tensor(pos, device=x.device)
        out[pt] = kernel.apply(weights, i, x[pt // K]) * w[pt].unsqueeze(-1)
    return out


def fused_run(fused, slots, x, w, idx, batches, T):
    out = torch.full((T * K, H), float("nan"), dtype=torch.bfloat16, device=x.device)
    h = torch.empty(T * K, I, dtype=torch.bfloat16, device=x.device)
    flat = idx.view(-1).tolist()
    for b in batches:
        work = torch.tensor([b, [flat[p] for p in b]], dtype=torch.int32).to(x.device)
        fused.run(slots, x, w, work, h, out, K)
    return out


def timed(fn, repeat=50):
    """Median milliseconds of fn on the device (CUDA events)."""
    ts = sorted(cuda_time(fn, repeat))
    return ts[len(ts) // 2] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("Error: this check needs a CUDA GPU", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    layout, slots = make_slots(dev)
    kernel = GptOssExpertKernel(layout, torch.bfloat16, 1.702, 7.0)
    fused = kernel.fused(dev)
    if fused is None:
        print("Error: the fused kernels are not available here (is triton installed?)", file=sys.stderr)
        return 1
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    result["triton"] = triton.__version__
    g = torch.Generator().manual_seed(1)
    for T in (1, 8):
        x = (torch.randn(T, H, generator=g) * 0.5).to(torch.bfloat16).to(dev)
        w = torch.softmax(torch.randn(T * K, generator=g), 0).to(torch.bfloat16).to(dev)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        want = generic(kernel, slots, x, w, idx, T)
        together = fused_run(fused, slots, x, w, idx, [list(range(T * K))], T)
        single = fused_run(fused, slots, x, w, idx, [[p] for p in reversed(range(T * K))], T)
        half = T * K // 2
        waves = fused_run(fused, slots, x, w, idx, [list(range(half, T * K)), list(range(half))], T)
        scale = want.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-6)
        r = {
            "bit_identical_share_vs_generic": (together == want).float().mean().item(),
            "max_diff_rel_to_row_scale_vs_generic": ((together.float() - want.float()).abs() / scale).max().item(),
            "batch_invariant": bool(torch.equal(together, single) and torch.equal(together, waves)),
            "generic_batch_invariant": None,
        }
        # the generic path with all experts in one batched call vs. one at a time
        experts = sorted(set(idx.view(-1).tolist()))
        if T == 1:
            wts = kernel.weights(slots, experts)
            xs = x.expand(len(experts), 1, H).contiguous()
            batched = kernel.apply_batched(wts, xs)[:, 0]
            one = torch.stack([kernel.apply_batched(kernel.weights(slots, [e]), x[None])[0, 0] for e in experts])
            r["generic_batch_invariant"] = bool(torch.equal(batched, one))
        n = len(experts)
        wts_ids = experts
        r["fused_ms"] = timed(lambda: fused_run(fused, slots, x, w, idx, [list(range(T * K))], T))
        r["generic_ms"] = timed(lambda: generic(kernel, slots, x, w, idx, T))
        r["generic_weights_plus_batched_ms"] = timed(
            lambda: kernel.apply_batched(kernel.weights(slots, wts_ids), x[:1].expand(n, 1, H).contiguous())) if T == 1 else None
        result[f"tokens_{T}"] = r
        print(f"T={T}: {json.dumps(r)}", file=sys.stderr)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
