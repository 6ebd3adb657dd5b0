"""MXFP4 (OCP microscaling FP4) dequantization for expert weights, CPU or CUDA.

Stored form (openai/gpt-oss): for a weight with ``out`` rows and ``in`` columns,
  blocks uint8 [..., out, in/32, 16]: two E2M1 codes per byte, low nibble = even element,
  scales uint8 [..., out, in/32]: one E8M0 exponent per 32 elements, value 2**(s - 127).
The dequantized weight is returned in transformers' GptOssExperts layout, [..., in, out]
(contiguous), so ``x @ w`` is the projection exactly as the bf16 model computes it.

Every step is elementwise or a reshape, so dequantizing a batch of experts at once
gives bit-identical values to dequantizing them one by one.
"""

from __future__ import annotations

import torch

# The 16 E2M1 values, indexed by the 4-bit code (bit 3 = sign).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # elements per scale
SCALE_BIAS = 127

_LUT_CACHE: dict[tuple, torch.Tensor] = {}


def _pair_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2] table: byte -> (value of low nibble, value of high nibble)."""
    key = (dtype, str(device))
    lut = _LUT_CACHE.get(key)
    if lut is None:
        codes = torch.arange(256)
        vals = torch.tensor(FP4_VALUES, dtype=torch.float32)
        lut = torch.stack((vals[codes & 0x0F], vals[codes >> 4]), dim=-1).to(device=device, dtype=dtype)
        _LUT_CACHE[key] = lut
    return lut


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., out, G, 16] uint8 + scales [..., out, G] uint8 -> weight [..., in = G*32, out] in dtype.

    fp4 values and powers of two are exact in bf16 / fp32, so the products are exact
    (no rounding) except where they leave the dtype's range.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    *lead, out, groups, nbytes = blocks.shape
    if nbytes != BLOCK // 2 or tuple(scales.shape) != (*lead, out, groups):
        raise ValueError(f"MXFP4 shapes do not match: blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)}")
    lut = _pair_lut(dtype, blocks.device)
    # Work in the transposed order so the result comes out [.., in, out] contiguous:
    # codes [..., G, 16, out] -> values [..., G, 16, out, 2] -> [..., G, 16, 2, out] = [..., in, out].
    codes = blocks.movedim(-3, -1).contiguous()  # [..., G, 16, out]
    vals = lut[codes.long()]  # [..., G, 16, out, 2]
    exp = scales.movedim(-2, -1).to(torch.int32) - SCALE_BIAS  # [..., G, out]
    factor = torch.pow(2.0, exp.to(torch.float32)).to(dtype)  # exact powers of two
    w = torch.empty((*lead, groups, BLOCK // 2, 2, out), dtype=dtype, device=blocks.device)
    torch.mul(vals.movedim(-1, -2), factor[..., :, None, None, :], out=w)
    return w.view(*lead, groups * BLOCK, out)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., in, out] (float) -> (blocks [..., out, in/32, 16], scales [..., out, in/32]).

    Round-to-nearest onto the E2M1 grid with a per-block power-of-two scale chosen so
    the block's largest magnitude maps to at most 6. Used to write MXFP4 checkpoints
    from float weights; ``dequantize(quantize(w))`` is w rounded to MXFP4.
    """
    *lead, n_in, n_out = weight.shape
    if n_in % BLOCK:
        raise ValueError(f"input features must be a multiple of {BLOCK}, got {n_in}")
    w = weight.detach().to(torch.float32).movedim(-1, -2).reshape(*lead, n_out, n_in // BLOCK, BLOCK)
    amax = w.abs().amax(dim=-1)  # [..., out, G]
    exp = torch.ceil(torch.log2(torch.clamp(amax, min=2.0**-126) / 6.0)).clamp(-127, 127)
    scaled = w / torch.pow(2.0, exp)[..., None]
    grid = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=w.device)
    mag = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1)  # [..., out, G, 32] code of |value|
    code = (mag | ((scaled < 0).to(torch.long) << 3)).to(torch.uint8)
    code = torch.where(mag == 0, torch.zeros_like(code), code)  # no negative zero
    pairs = code.view(*lead, n_out, n_in // BLOCK, BLOCK // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    scales = (exp + SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
