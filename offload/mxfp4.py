"""MXFP4 (OCP microscaling FP4) dequantization for expert weights, CPU or CUDA.

Stored form (openai/gpt-oss): for a weight with ``out`` rows and ``in`` columns,
  blocks uint8 [..., out, in/32, 16]: two E2M1 codes per byte, low nibble = even element,
  scales uint8 [..., out, in/32]: one E8M0 exponent per 32 elements, value 2**(s - 127).
``dequantize`` returns the weight in transformers' GptOssExperts layout, [..., in, out]
(contiguous), so ``x @ w`` is the projection exactly as the bf16 model computes it;
``dequantize_rows`` returns [..., out, in] without the transposing copy (the GPU path
multiplies by its transposed view).

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


def _scaled_pair_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[65536] table indexed by scale * 256 + byte: the byte's two dequantized values
    (low nibble first), packed in one int32 (bf16 / fp16) or int64 (fp32)."""
    key = (dtype, str(device))
    lut = _LUT_CACHE.get(key)
    if lut is None:
        vals = torch.tensor(FP4_VALUES, dtype=torch.float32)
        codes = torch.arange(256)
        pair = torch.stack((vals[codes & 0x0F], vals[codes >> 4]), dim=-1)  # [256 bytes, 2]
        exp = torch.arange(256, dtype=torch.int32) - SCALE_BIAS  # [256 scales]
        scaled = torch.ldexp(pair[None, :, :], exp[:, None, None].float())  # [scale, byte, 2], exact
        packed = scaled.to(dtype).contiguous().view(torch.int64 if dtype == torch.float32 else torch.int32)
        lut = packed.reshape(65536).to(device)
        _LUT_CACHE[key] = lut
    return lut


def _check(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"MXFP4 shapes do not match: blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"MXFP4 dequantizes to bfloat16, float16 or float32, not {dtype}")


def dequantize_rows(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., out, G, 16] + scales [..., out, G] -> weight rows [..., out, in = G*32] (contiguous).

    One gather from a 64K-entry table indexed by (scale, byte): three passes over the
    data, no separate scale multiply. ``w.transpose(-1, -2)`` is transformers' [in, out].
    """
    _check(blocks, scales, dtype)
    *lead, out, groups, _ = blocks.shape
    lut = _scaled_pair_lut(dtype, blocks.device)
    idx = blocks.to(torch.int32, memory_format=torch.contiguous_format)  # [..., out, G, 16]
    idx.add_(scales.to(torch.int32).unsqueeze(-1), alpha=256)  # scale * 256 + byte
    pairs = lut.index_select(0, idx.view(-1))  # one packed value pair per byte
    return pairs.view(dtype).view(*lead, out, groups * BLOCK)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., out, G, 16] uint8 + scales [..., out, G] uint8 -> weight [..., in = G*32, out] in dtype.

    fp4 values and powers of two are exact in bf16 / fp32, so the products are exact
    (no rounding) except where they leave the dtype's range. Contiguous, in the layout
    of transformers' GptOssExperts parameters.
    """
    return dequantize_rows(blocks, scales, dtype).transpose(-1, -2).contiguous()


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
