"""Fused dense / FP8 expert kernels (Triton) for small token counts: decode and verify blocks.

For families whose experts are a SiLU-gated MLP without biases (Qwen3-MoE):

  gate, up = x @ W1^T (W1 = gate_up_proj [2I, H], gate rows first);  h = silu(gate) * up
  y = h @ W2^T (W2 = down_proj [H, I]);  contrib = y * routing weight

The generic path (qwen3_moe.Qwen3ExpertKernel) gathers each expert's weights, dequantizes FP8
ones through a float32 temporary and runs about ten kernels per expert, so a Qwen3 decode step
(48 layers x 8 experts) is launch-bound. Here two kernels per layer compute every (token, expert)
pair of a batch, reading the slot bytes directly:

  1. ``gate_up_silu``: for each pair p = t * K + k and a tile of the I intermediate features
     -> h [P, I];
  2. ``down``: y = h_p @ W2^T times the pair's routing weight -> contrib [P, H].

Weights are read in their stored dtype (bf16, fp16, float32, or float8_e4m3fn with a float32 /
bf16 scale per BLK x BLK block); an FP8 weight is multiplied by its block scale in float32 and
rounded once to the compute dtype, as transformers dequantizes. Every intermediate is rounded
where transformers' bf16 module rounds (matmul outputs, SiLU, the product, the weighted output),
with float32 accumulation; only the summation order inside a dot product differs from cuBLAS.

Batch invariance: one program computes one pair's output tile with a fixed tile shape and a
fixed reduction order, so a pair's result is the same whatever else is computed with it (hits or
misses, one token or a verify block, any cache size), as in mxfp4_triton.py.
"""

from __future__ import annotations

import torch

from pdflash.offload.mxfp4_triton import available  # noqa: F401  (same conditions: Triton on CUDA, or its interpreter)
from pdflash.offload.mxfp4_triton import block_n

BLOCK_C = 256  # weight elements per row per loop step

_KERNELS = None
_DENSE = (torch.bfloat16, torch.float16, torch.float32)


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        from pdflash.offload import triton_kernels

        _KERNELS = triton_kernels
    return _KERNELS


def supported(layout, dtype: torch.dtype) -> bool:
    """Whether the kernels compute experts of ``layout`` in ``dtype`` (bf16 or float32 compute;
    dense weights, or FP8 e4m3 with square scale blocks)."""
    if dtype not in (torch.bfloat16, torch.float32):
        return False
    gu, dn = layout.piece("gate_up_proj"), layout.piece("down_proj")
    if gu.dtype != dn.dtype or (gu.dtype not in _DENSE and gu.dtype != torch.float8_e4m3fn):
        return False
    return gu.dtype != torch.float8_e4m3fn or _block(layout) is not None


def _block(layout) -> int | None:
    """The FP8 scale block size b (square), or None when the scale grids are not b x b blocks."""
    gu, gs = layout.piece("gate_up_proj"), layout.piece("gate_up_proj_scale_inv")
    dn, ds = layout.piece("down_proj"), layout.piece("down_proj_scale_inv")
    b = gu.shape[0] // gs.shape[0]
    for w, s in ((gu, gs), (dn, ds)):
        if any(wd != sd * b for wd, sd in zip(w.shape, s.shape)):
            return None
    return b


class FusedDenseExperts:
    """Launches the two kernels for one batch of (pair, slot) work items; see the module docstring."""

    def __init__(self, layout, dtype: torch.dtype):
        if not supported(layout, dtype):
            raise ValueError("the fused dense kernels do not support this expert layout / dtype")
        gu, dn = layout.piece("gate_up_proj"), layout.piece("down_proj")
        self.dtype = dtype
        self.inter = gu.shape[0] // 2
        self.hidden = gu.shape[1]
        self.wdtype = gu.dtype
        self.fp8 = gu.dtype == torch.float8_e4m3fn
        self.block = _block(layout) if self.fp8 else 1
        esize = torch.empty(0, dtype=gu.dtype).element_size()
        for p in (gu, dn):
            if p.offset % esize or layout.expert_bytes % esize:
                raise ValueError("weight pieces must be aligned to their element size for the fused kernels")
        self.w_off = (gu.offset // esize, dn.offset // esize)
        if self.fp8:
            gs, ds = layout.piece("gate_up_proj_scale_inv"), layout.piece("down_proj_scale_inv")
            self.sdtype = gs.dtype
            ssize = torch.empty(0, dtype=gs.dtype).element_size()
            if gs.dtype != ds.dtype or gs.offset % ssize or ds.offset % ssize or layout.expert_bytes % ssize:
                raise ValueError("scale pieces must share one dtype and be aligned to it for the fused kernels")
            self.s_off = (gs.offset // ssize, ds.offset // ssize)
        else:
            self.sdtype, self.s_off = gu.dtype, (0, 0)

    def run(self, slots: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, work: torch.Tensor,
            h: torch.Tensor, contrib: torch.Tensor, top_k: int) -> None:
        """x [T, H]; weights [T * K] routing weights; work int32 [2, n] (pair ids, slot ids) on the
        device; h [T * K, I] scratch in the compute dtype; contrib [T * K, H] receives rows p."""
        k = _kernels()
        n = work.shape[1]
        if n == 0:
            return
        I, H = self.inter, self.hidden
        wv = slots.view(torch.uint8 if self.fp8 else self.wdtype)
        sv = slots.view(self.sdtype) if self.fp8 else wv
        bf16 = self.dtype == torch.bfloat16
        bn = block_n(slots.device)  # output features per program, as mxfp4_triton's
        k.dense_gate_up_silu[(n, k.triton.cdiv(I, bn))](
            x, x.stride(0), work, n, wv, wv.stride(0), sv, sv.stride(0), h, self.w_off[0], self.s_off[0], I, top_k,
            NCOL=H, BLK=self.block, BN=bn, BC=BLOCK_C, FP8=self.fp8, BF16=bf16,
        )
        k.dense_down[(n, k.triton.cdiv(H, bn))](
            h, weights, work, n, wv, wv.stride(0), sv, sv.stride(0), contrib, self.w_off[1], self.s_off[1], H,
            NCOL=I, BLK=self.block, BN=bn, BC=BLOCK_C, FP8=self.fp8, BF16=bf16,
            OUT_BF16=contrib.dtype == torch.bfloat16,
        )
