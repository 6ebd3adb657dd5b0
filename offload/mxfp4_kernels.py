"""Triton kernels of the fused MXFP4 expert path; see mxfp4_triton.py for what they compute.

Imported only when the fused path is used (this module imports triton at the top, as
Triton resolves the helpers a kernel calls through the module's globals).
"""

import triton
import triton.language as tl


@triton.jit
def _mxfp4_rows_dot(base, blocks_off, scales_off, rows, rmask, v_ptr, lut_ptr,
                    NB: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr):
    """[BN] float32: rows `rows` of an MXFP4 weight (NB bytes per row) dot vector v (2*NB)."""
    acc = tl.zeros([BN], dtype=tl.float32)
    for c0 in range(0, NB, BC):
        c = c0 + tl.arange(0, BC)
        cmask = c < NB
        m = rmask[:, None] & cmask[None, :]
        b = tl.load(base + blocks_off + rows[:, None] * NB + c[None, :], mask=m, other=0).to(tl.int32)
        s = tl.load(base + scales_off + rows[:, None] * (NB // 16) + (c // 16)[None, :], mask=m, other=127)
        scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2 ** (s - 127), exact
        lo = tl.load(lut_ptr + (b & 15))
        hi = tl.load(lut_ptr + (b >> 4))
        xe = tl.load(v_ptr + 2 * c, mask=cmask, other=0.0).to(tl.float32)
        xo = tl.load(v_ptr + 2 * c + 1, mask=cmask, other=0.0).to(tl.float32)
        acc += tl.sum((lo * xe[None, :] + hi * xo[None, :]) * scale, axis=1)
    return acc

@triton.jit
def _round(v, BF16: tl.constexpr):
    """float32 -> nearest bfloat16 value (ties to even), kept in float32; identity for float32.

    Written with integer bit operations so that Triton's CPU interpreter (whose float casts
    truncate) rounds exactly as the GPU does.
    """
    if BF16:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        v = b.to(tl.float32, bitcast=True)
    return v


@triton.jit
def gate_up_glu(x_ptr, x_stride, work_ptr, n_work, slots_ptr, slot_bytes, bias_ptr, bias_stride, lut_ptr, h_ptr,
                 w_off, s_off, b_off, I, K, limit, alpha,
                 NB: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, BF16: tl.constexpr):
    i = tl.program_id(0)
    p = tl.load(work_ptr + i).to(tl.int64)  # pair = t * K + k
    slot = tl.load(work_ptr + n_work + i).to(tl.int64)
    t = p // K
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    jm = j < I
    base = slots_ptr + slot * slot_bytes
    v = x_ptr + t * x_stride
    gate = _mxfp4_rows_dot(base, w_off, s_off, 2 * j, jm, v, lut_ptr, NB, BN, BC)
    up = _mxfp4_rows_dot(base, w_off, s_off, 2 * j + 1, jm, v, lut_ptr, NB, BN, BC)
    bb = bias_ptr + slot * bias_stride + b_off
    gate = _round(_round(gate, BF16) + _round(tl.load(bb + 2 * j, mask=jm, other=0.0).to(tl.float32), BF16), BF16)
    up = _round(_round(up, BF16) + _round(tl.load(bb + 2 * j + 1, mask=jm, other=0.0).to(tl.float32), BF16), BF16)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    sig = _round(tl.sigmoid(_round(gate * alpha, BF16)), BF16)
    glu = _round(gate * sig, BF16)
    out = _round(up + 1.0, BF16) * glu
    tl.store(h_ptr + p * I + j, _round(out, BF16).to(h_ptr.dtype.element_ty), mask=jm)


@triton.jit
def down(h_ptr, rw_ptr, work_ptr, n_work, slots_ptr, slot_bytes, bias_ptr, bias_stride, lut_ptr, out_ptr,
          w_off, s_off, b_off, H,
          NB: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, BF16: tl.constexpr, OUT_BF16: tl.constexpr):
    i = tl.program_id(0)
    p = tl.load(work_ptr + i).to(tl.int64)
    slot = tl.load(work_ptr + n_work + i).to(tl.int64)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    jm = j < H
    base = slots_ptr + slot * slot_bytes
    y = _mxfp4_rows_dot(base, w_off, s_off, j, jm, h_ptr + p * (2 * NB), lut_ptr, NB, BN, BC)
    bias = _round(tl.load(bias_ptr + slot * bias_stride + b_off + j, mask=jm, other=0.0).to(tl.float32), BF16)
    y = _round(_round(y, BF16) + bias, BF16)
    wt = tl.load(rw_ptr + p).to(tl.float32)
    tl.store(out_ptr + p * H + j, _round(y * wt, OUT_BF16).to(out_ptr.dtype.element_ty), mask=jm)
