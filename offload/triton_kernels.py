"""Triton kernels of the fused expert paths: MXFP4 (gpt-oss; see mxfp4_triton.py for what they
compute) and dense / FP8 with SiLU (Qwen3-MoE; see dense_triton.py).

Imported only when a fused path is used (this module imports triton at the top). Every kernel
and the helpers it calls live in this one module: Triton resolves a helper through the calling
kernel's module globals, and its CPU interpreter patches only those.
"""

import triton
import triton.language as tl


@triton.jit
def _work_item(work_ptr, n_work, N, BN: tl.constexpr):
    """This program's (token, expert) pair p = t * K + k, the cache slot it reads, and its tile of
    BN output features j < N (with the mask): ``work`` holds n_work pairs, then their n_work slots."""
    i = tl.program_id(0)
    p = tl.load(work_ptr + i).to(tl.int64)
    slot = tl.load(work_ptr + n_work + i).to(tl.int64)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    return p, slot, j, j < N


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
def mxfp4_gate_up_glu(x_ptr, x_stride, work_ptr, n_work, slots_ptr, slot_bytes, bias_ptr, bias_stride, lut_ptr, h_ptr,
                 w_off, s_off, b_off, I, K, limit, alpha,
                 NB: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, BF16: tl.constexpr):
    p, slot, j, live = _work_item(work_ptr, n_work, I, BN)
    jm = live & ((j * 0 + slot) >= 0)  # a pair whose expert is not here (slot -1) reads nothing: its h row is 0
    t = p // K
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
    out = tl.where(jm, _round(up + 1.0, BF16) * glu, 0.0)
    tl.store(h_ptr + p * I + j, _round(out, BF16).to(h_ptr.dtype.element_ty), mask=live)


@triton.jit
def mxfp4_down(h_ptr, rw_ptr, work_ptr, n_work, slots_ptr, slot_bytes, bias_ptr, bias_stride, lut_ptr, out_ptr,
          w_off, s_off, b_off, H,
          NB: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, BF16: tl.constexpr, OUT_BF16: tl.constexpr):
    p, slot, j, live = _work_item(work_ptr, n_work, H, BN)
    jm = live & ((j * 0 + slot) >= 0)  # a pair whose expert is not here (slot -1) reads nothing: its row is 0
    base = slots_ptr + slot * slot_bytes
    y = _mxfp4_rows_dot(base, w_off, s_off, j, jm, h_ptr + p * (2 * NB), lut_ptr, NB, BN, BC)
    bias = _round(tl.load(bias_ptr + slot * bias_stride + b_off + j, mask=jm, other=0.0).to(tl.float32), BF16)
    y = _round(_round(y, BF16) + bias, BF16)
    wt = tl.load(rw_ptr + p).to(tl.float32)
    y = tl.where(jm, y * wt, 0.0)
    tl.store(out_ptr + p * H + j, _round(y, OUT_BF16).to(out_ptr.dtype.element_ty), mask=live)


# -- dense / FP8 experts with SiLU (dense_triton.py) --------------------------------------

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
def _dense_rows_dot(w_base, s_base, rows, rmask, v_ptr,
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
def dense_gate_up_silu(x_ptr, x_stride, work_ptr, n_work, w_ptr, w_slot, s_ptr, s_slot, h_ptr, w_off, s_off, I, K,
                 NCOL: tl.constexpr, BLK: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
                 FP8: tl.constexpr, BF16: tl.constexpr):
    p, slot, j, jm = _work_item(work_ptr, n_work, I, BN)
    t = p // K
    wb = w_ptr + slot * w_slot + w_off
    sb = s_ptr + slot * s_slot + s_off
    v = x_ptr + t * x_stride
    gate = _round(_dense_rows_dot(wb, sb, j, jm, v, NCOL, BLK, BN, BC, FP8, BF16), BF16)  # rows 0 .. I-1
    up = _round(_dense_rows_dot(wb, sb, I + j, jm, v, NCOL, BLK, BN, BC, FP8, BF16), BF16)  # rows I .. 2I-1
    act = _round(gate / (1.0 + tl.exp(-gate)), BF16)  # SiLU
    tl.store(h_ptr + p * I + j, _round(act * up, BF16).to(h_ptr.dtype.element_ty), mask=jm)


@triton.jit
def dense_down(h_ptr, rw_ptr, work_ptr, n_work, w_ptr, w_slot, s_ptr, s_slot, out_ptr, w_off, s_off, H,
         NCOL: tl.constexpr, BLK: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
         FP8: tl.constexpr, BF16: tl.constexpr, OUT_BF16: tl.constexpr):
    p, slot, j, jm = _work_item(work_ptr, n_work, H, BN)
    wb = w_ptr + slot * w_slot + w_off
    sb = s_ptr + slot * s_slot + s_off
    y = _round(_dense_rows_dot(wb, sb, j, jm, h_ptr + p * NCOL, NCOL, BLK, BN, BC, FP8, BF16), BF16)
    wt = tl.load(rw_ptr + p).to(tl.float32)
    tl.store(out_ptr + p * H + j, _round(y * wt, OUT_BF16).to(out_ptr.dtype.element_ty), mask=jm)


# -- decode attention (gpt-oss; see attn_triton.py for what they compute) -----------------------

@triton.jit
def rms_norm(x_ptr, a_ptr, xo_ptr, w_ptr, y_ptr, H, eps,
             ADD: tl.constexpr, BH: tl.constexpr, BF16: tl.constexpr):
    """One row: (ADD: x = x + a, rounded and stored to xo) y = w * (x * rsqrt(mean(x^2) + eps))."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BH)
    cm = c < H
    x = tl.load(x_ptr + r * H + c, mask=cm, other=0.0).to(tl.float32)
    if ADD:
        x = _round(x + tl.load(a_ptr + r * H + c, mask=cm, other=0.0).to(tl.float32), BF16)
        tl.store(xo_ptr + r * H + c, x.to(xo_ptr.dtype.element_ty), mask=cm)
    var = tl.sum(x * x, axis=0) / H
    h = x * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * H + c, _round(w * h, BF16).to(y_ptr.dtype.element_ty), mask=cm)


@triton.jit
def rope_kv(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, kc_ptr, vc_ptr, NQ, NKV, cache_len,
            HALF: tl.constexpr, BF16: tl.constexpr):
    """Program (t, head): rotate row t's query head (heads < NQ, into qo) or key head (into the
    key cache at position pos[t], with the value head into the value cache)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + t * HALF + d).to(tl.float32)
    sin = tl.load(sin_ptr + t * HALF + d).to(tl.float32)
    if h < NQ:
        src = q_ptr + (t * NQ + h) * 2 * HALF
        dst = qo_ptr + (t * NQ + h) * 2 * HALF
    else:
        j = h - NQ
        src = k_ptr + (t * NKV + j) * 2 * HALF
        p = tl.load(pos_ptr + t)
        dst = kc_ptr + (j * cache_len + p) * 2 * HALF
        vsrc = v_ptr + (t * NKV + j) * 2 * HALF
        vdst = vc_ptr + (j * cache_len + p) * 2 * HALF
        tl.store(vdst + d, tl.load(vsrc + d))
        tl.store(vdst + HALF + d, tl.load(vsrc + HALF + d))
    a = tl.load(src + d).to(tl.float32)
    b = tl.load(src + HALF + d).to(tl.float32)
    first = _round(_round(a * cos, BF16) - _round(b * sin, BF16), BF16)
    second = _round(_round(b * cos, BF16) + _round(a * sin, BF16), BF16)
    tl.store(dst + d, first.to(dst.dtype.element_ty))
    tl.store(dst + HALF + d, second.to(dst.dtype.element_ty))


@triton.jit
def _attn_scores(q, kc_base, mask_row, n0, n_keys, scaling, D: tl.constexpr, BN: tl.constexpr, BF16: tl.constexpr):
    """[BN] scores of keys n0 .. n0 + BN - 1 against q [D], as the eager path rounds them
    (q.k, times scaling, plus the additive mask); -inf past n_keys."""
    n = n0 + tl.arange(0, BN)
    nm = n < n_keys
    d = tl.arange(0, D)
    k = tl.load(kc_base + n[:, None] * D + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
    s = _round(tl.sum(k * q[None, :], axis=1), BF16)
    s = _round(s * scaling, BF16)
    s = _round(s + tl.load(mask_row + n, mask=nm, other=0.0).to(tl.float32), BF16)
    return tl.where(nm, s, float("-inf")), n, nm


@triton.jit
def attn_decode(q_ptr, kc_ptr, vc_ptr, mask_ptr, sinks_ptr, out_ptr, pos_ptr, n_keys, mask_stride, cache_len, scaling,
                NQ, GROUP, window, D: tl.constexpr, BN: tl.constexpr, BF16: tl.constexpr):
    """Program (t, head): softmax over [scores of the keys, the head's sink] (the sink's share
    dropped), times the values -> out[t, head]. Three passes over the keys (max, sum, output)
    so that each probability is rounded where the eager path rounds it. ``window`` > 0 (a
    sliding layer): the blocks wholly before row t's window (position pos[t] - window + 1),
    which its mask hides, are skipped (their probabilities are exactly 0)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (t * NQ + h) * D + d).to(tl.float32)
    kv = (h // GROUP).to(tl.int64)
    kc = kc_ptr + kv * cache_len * D
    vc = vc_ptr + kv * cache_len * D
    mrow = mask_ptr + t * mask_stride
    sink = tl.load(sinks_ptr + h).to(tl.float32)
    first = tl.maximum(tl.load(pos_ptr + t) - window + 1, 0)  # the window's first position
    lo = tl.where(window > 0, first // BN * BN, 0)
    m = sink
    for n0 in range(lo, n_keys, BN):
        s, n, nm = _attn_scores(q, kc, mrow, n0, n_keys, scaling, D, BN, BF16)
        m = tl.maximum(m, tl.max(s, axis=0))
    total = tl.exp(_round(sink - m, BF16))
    for n0 in range(lo, n_keys, BN):
        s, n, nm = _attn_scores(q, kc, mrow, n0, n_keys, scaling, D, BN, BF16)
        total += tl.sum(tl.where(nm, tl.exp(_round(s - m, BF16)), 0.0), axis=0)
    acc = tl.zeros([D], dtype=tl.float32)
    for n0 in range(lo, n_keys, BN):
        s, n, nm = _attn_scores(q, kc, mrow, n0, n_keys, scaling, D, BN, BF16)
        p = _round(tl.where(nm, tl.exp(_round(s - m, BF16)) / total, 0.0), BF16)
        v = tl.load(vc + n[:, None] * D + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(p[:, None] * v, axis=0)
    tl.store(out_ptr + (t * NQ + h) * D + d, _round(acc, BF16).to(out_ptr.dtype.element_ty))


# -- a host step's expert output into the residual stream (host_graph.py) -----------------------

@triton.jit
def moe_residual(x_ptr, c_ptr, u_ptr, out_ptr, H,
                 K: tl.constexpr, HAS_C: tl.constexpr, C_BF16: tl.constexpr, X_BF16: tl.constexpr,
                 BH: tl.constexpr):
    """Program (row r, feature tile): out[r] = x[r] + to_x(sum over k of to_c(c[r*K+k] + u[r*K+k])),
    without c (HAS_C False) the sum of to_c(u[r*K+k]): the torch ops ``c.add_(u)`` (c in its own
    dtype), ``.view(R, K, H).sum(dim=1)`` (float32 accumulation from the first term, k in order),
    ``.to(x.dtype)`` and the residual add, each rounded where they round (C_BF16: c's dtype,
    X_BF16: x's and out's)."""
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BH + tl.arange(0, BH)
    m = j < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for k in tl.static_range(K):
        s = tl.load(u_ptr + (r * K + k) * H + j, mask=m, other=0.0).to(tl.float32)
        if HAS_C:
            s = tl.load(c_ptr + (r * K + k) * H + j, mask=m, other=0.0).to(tl.float32) + s
        s = _round(s, C_BF16)
        if k == 0:
            acc = s
        else:
            acc = acc + s
    e = _round(_round(acc, C_BF16), X_BF16)
    x = tl.load(x_ptr + r * H + j, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * H + j, _round(x + e, X_BF16).to(out_ptr.dtype.element_ty), mask=m)
