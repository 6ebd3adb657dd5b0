"""Triton kernels of the fused dense / FP8 expert path; see dense_triton.py for what they compute.

Imported only when that path is used (Triton resolves the helpers a kernel calls through this
module's globals).
"""

import triton
import triton.language as tl

from pdflash.offload.mxfp4_kernels import _round


@triton.jit
def _fp8_e4m3(q):
    """int32 bytes of float8_e4m3fn -> their float32 values, exactly (integer decode, so Triton's
    CPU interpreter agrees with the GPU)."""
    sign = (q >> 7) & 1
    e = (q >> 3) & 15
    m = q & 7
    normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # e == 0: m * 2**-9
    sub = tl.where(sign == 1, -sub, sub)
    v = tl.where(e == 0, sub, normal)
    nan = ((q & 0) | 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where((e == 15) & (m == 7), nan, v)


@triton.jit
def _rows_dot(w_base, s_base, rows, rmask, v_ptr,
              NCOL: tl.constexpr, BLK: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
              FP8: tl.constexpr, BF16: tl.constexpr):
    """[BN] float32: rows ``rows`` of a [R, NCOL] weight dot vector v. Dense weights are read in
    their stored dtype and rounded to the compute dtype; FP8 weights are multiplied by the scale
    of their BLK x BLK block in float32 and rounded once (transformers' dequantization)."""
    acc = tl.zeros([BN], dtype=tl.float32)
    for c0 in range(0, NCOL, BC):
        c = c0 + tl.arange(0, BC)
        cmask = c < NCOL
        m = rmask[:, None] & cmask[None, :]
        raw = tl.load(w_base + rows[:, None] * NCOL + c[None, :], mask=m, other=0)
        if FP8:
            s = tl.load(s_base + (rows // BLK)[:, None] * (NCOL // BLK) + (c // BLK)[None, :], mask=m, other=0.0)
            w = _round(_fp8_e4m3(raw.to(tl.int32)) * s.to(tl.float32), BF16)
        else:
            w = _round(raw.to(tl.float32), BF16)
        xv = tl.load(v_ptr + c, mask=cmask, other=0.0).to(tl.float32)
        acc += tl.sum(w * xv[None, :], axis=1)
    return acc


@triton.jit
def gate_up_silu(x_ptr, x_stride, work_ptr, n_work, w_ptr, w_slot, s_ptr, s_slot, h_ptr, w_off, s_off, I, K,
                 NCOL: tl.constexpr, BLK: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
                 FP8: tl.constexpr, BF16: tl.constexpr):
    i = tl.program_id(0)
    p = tl.load(work_ptr + i).to(tl.int64)  # pair = t * K + k
    slot = tl.load(work_ptr + n_work + i).to(tl.int64)
    t = p // K
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    jm = j < I
    wb = w_ptr + slot * w_slot + w_off
    sb = s_ptr + slot * s_slot + s_off
    v = x_ptr + t * x_stride
    gate = _round(_rows_dot(wb, sb, j, jm, v, NCOL, BLK, BN, BC, FP8, BF16), BF16)  # rows 0 .. I-1
    up = _round(_rows_dot(wb, sb, I + j, jm, v, NCOL, BLK, BN, BC, FP8, BF16), BF16)  # rows I .. 2I-1
    act = _round(gate / (1.0 + tl.exp(-gate)), BF16)  # SiLU
    tl.store(h_ptr + p * I + j, _round(act * up, BF16).to(h_ptr.dtype.element_ty), mask=jm)


@triton.jit
def down(h_ptr, rw_ptr, work_ptr, n_work, w_ptr, w_slot, s_ptr, s_slot, out_ptr, w_off, s_off, H,
         NCOL: tl.constexpr, BLK: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
         FP8: tl.constexpr, BF16: tl.constexpr, OUT_BF16: tl.constexpr):
    i = tl.program_id(0)
    p = tl.load(work_ptr + i).to(tl.int64)
    slot = tl.load(work_ptr + n_work + i).to(tl.int64)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    jm = j < H
    wb = w_ptr + slot * w_slot + w_off
    sb = s_ptr + slot * s_slot + s_off
    y = _round(_rows_dot(wb, sb, j, jm, h_ptr + p * NCOL, NCOL, BLK, BN, BC, FP8, BF16), BF16)
    wt = tl.load(rw_ptr + p).to(tl.float32)
    tl.store(out_ptr + p * H + j, _round(y * wt, OUT_BF16).to(out_ptr.dtype.element_ty), mask=jm)
