"""Fused MXFP4 expert kernels (Triton) for small token counts: decode and verify blocks.

The generic path (gpt_oss.GptOssExpertKernel) dequantizes each expert to the compute dtype in
device memory and multiplies with cuBLAS: about 4 bytes written and read back per weight byte,
and some thirty kernel launches per layer. For a handful of tokens the expert maths is a
matrix-vector product per (token, expert) pair, so these kernels read the packed slot bytes
directly, dequantize in registers and never materialise the weights:

  1. ``_gate_up_glu``: for each pair p = t * K + k (token t, its k-th expert) and a tile of the
     I intermediate features: gate / up = x_t @ W1 (+ b1), clamp, GLU  ->  h [P, I];
  2. ``_down``: y = h_p @ W2 + b2, times the routing weight of the pair  ->  contrib [P, H].

The caller sums contrib over k, as the generic path does.

Rounding: every intermediate is rounded to the compute dtype where transformers' bf16 module
rounds it (matmul output, bias add, each GLU step, weighted output), with float32 accumulation.
Only the summation order inside a dot product differs from cuBLAS, so results agree with the
generic path to the last bit or two of bf16, not bit for bit.

Batch invariance: one program computes one pair's output tile with a fixed tile shape and a
fixed reduction order, reading only that pair's token and expert. A pair's result is therefore
the same whatever else is computed with it: hits or misses, one token or a verify block, any
cache size. (The generic batched matmul picks cuBLAS kernels by batch shape, so there the last
bits depend on how many experts arrived together.)

Slot layout (host_store.ExpertLayout): per expert, gate_up_proj_blocks u8 [2I, H/32, 16],
gate_up_proj_scales u8 [2I, H/32], gate_up_proj_bias [2I], down_proj_blocks u8 [H, I/32, 16],
down_proj_scales u8 [H, I/32], down_proj_bias [H]. Byte c of a weight row holds elements 2c
(low nibble) and 2c + 1 (high nibble); its scale is byte c // 16 of the row's scales.

Triton is imported lazily; ``available()`` says whether these kernels can run here (a CUDA
device and an importable Triton; or Triton's CPU interpreter when TRITON_INTERPRET=1, which the
tests use).
"""

from __future__ import annotations

import os

import torch

from pdflash.offload.mxfp4 import FP4_VALUES

BLOCK_N = 16  # output features per program
# Triton's CPU interpreter runs a grid's programs one after another, each op a Python call: there
# fewer, wider programs take a fraction of the time. Every output feature's sum is the same.
BLOCK_N_CPU = 64
BLOCK_C = 128  # weight bytes per row per loop step (256 weights)
MAX_TOKENS = 16  # the generic grouped path takes longer forwards (prefill)

_KERNELS = None
_LUTS: dict[str, torch.Tensor] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device) -> bool:
    """True when the fused kernels can run for tensors on ``device``: on CUDA unless
    PDFLASH_FUSED_EXPERTS=0; on the CPU only through Triton's interpreter, when both
    TRITON_INTERPRET=1 and PDFLASH_FUSED_EXPERTS=1 are set (the tests)."""
    return triton_available(device, "PDFLASH_FUSED_EXPERTS")


def triton_available(device: torch.device, switch: str) -> bool:
    """Whether a fused Triton path switched by the environment variable ``switch`` runs for
    tensors on ``device``: on CUDA unless ``switch`` is "0"; on the CPU only through Triton's
    interpreter, with TRITON_INTERPRET=1 and ``switch`` "1"; never where Triton cannot import."""
    flag = os.environ.get(switch)
    if flag == "0":
        return False
    if device.type != "cuda" and not (device.type == "cpu" and flag == "1" and interpreting()):
        return False
    try:
        _kernels()
    except Exception:  # triton missing, or its import fails on this machine
        return False
    return True


def block_n(device: torch.device) -> int:
    """Output features per program of the fused expert kernels (this module's and dense_triton's)."""
    return BLOCK_N if device.type == "cuda" else BLOCK_N_CPU


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        from pdflash.offload import triton_kernels

        _KERNELS = triton_kernels
    return _KERNELS


def _lut(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _LUTS:
        _LUTS[key] = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
    return _LUTS[key]


class FusedMxfp4Experts:
    """Launches the two kernels for one batch of (pair, slot) work items; see the module docstring."""

    def __init__(self, layout, alpha: float, limit: float):
        self.layout = layout
        self.alpha = float(alpha)
        self.limit = float(limit)
        gu_b, gu_s, gu_bias = (layout.piece(n) for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias"))
        dn_b, dn_s, dn_bias = (layout.piece(n) for n in ("down_proj_blocks", "down_proj_scales", "down_proj_bias"))
        self.inter = gu_b.shape[0] // 2
        self.hidden = dn_b.shape[0]
        self.gu = (gu_b.offset, gu_s.offset, gu_bias)
        self.dn = (dn_b.offset, dn_s.offset, dn_bias)
        self.nb_gu = gu_b.shape[1] * 16  # bytes per gate_up row = H / 2
        self.nb_dn = dn_b.shape[1] * 16  # bytes per down row = I / 2
        for bias in (gu_bias, dn_bias):
            esize = torch.empty(0, dtype=bias.dtype).element_size()
            if bias.offset % esize or layout.expert_bytes % esize:
                raise ValueError("bias pieces must be aligned to their element size for the fused kernels")

    def run(self, slots: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, work: torch.Tensor,
            h: torch.Tensor, contrib: torch.Tensor, top_k: int) -> None:
        """x [T, H]; weights [T * K] routing weights; work int32 [2, n] (pair ids, slot ids) on the
        device; h [T * K, I] scratch in the compute dtype; contrib [T * K, H] receives rows p."""
        k = _kernels()
        cdiv = k.triton.cdiv
        n = work.shape[1]
        if n == 0:
            return
        I, H = self.inter, self.hidden
        bn = block_n(slots.device)
        lut = _lut(slots.device)
        gu_w, gu_s, gu_bias = self.gu
        dn_w, dn_s, dn_bias = self.dn
        gu_bias_view = slots.view(gu_bias.dtype)
        dn_bias_view = slots.view(dn_bias.dtype)
        esize_gu = gu_bias_view.element_size()
        esize_dn = dn_bias_view.element_size()
        k.mxfp4_gate_up_glu[(n, cdiv(I, bn))](
            x, x.stride(0), work, n, slots, slots.stride(0), gu_bias_view, gu_bias_view.stride(0), lut, h,
            gu_w, gu_s, gu_bias.offset // esize_gu, I, top_k, self.limit, self.alpha,
            NB=self.nb_gu, BN=bn, BC=BLOCK_C, BF16=h.dtype == torch.bfloat16,
        )
        k.mxfp4_down[(n, cdiv(H, bn))](
            h, weights, work, n, slots, slots.stride(0), dn_bias_view, dn_bias_view.stride(0), lut, contrib,
            dn_w, dn_s, dn_bias.offset // esize_dn, H,
            NB=self.nb_dn, BN=bn, BC=BLOCK_C, BF16=h.dtype == torch.bfloat16,
            OUT_BF16=contrib.dtype == torch.bfloat16,
        )
