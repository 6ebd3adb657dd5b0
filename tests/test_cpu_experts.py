"""The native CPU expert kernel (native/pf_cpu.c) against transformers' own expert maths.

The reference is transformers' GptOssExperts in float32 with one expert, its weights
dequantized from MXFP4 by transformers' converter (convert_moe_packed_tensors), routing
weight 1. Every dispatch level this CPU runs is checked, with 1..16 tokens (and more, which
the wrapper slices), 1..4 threads, MXFP4 / bf16 / float32 weights, float32 and bf16 inputs,
and sizes that do not divide evenly among the threads or the vector widths.
"""

import threading

import pytest
import torch

import stress_programs
from pdflash.native import NativeLibraryMissing
from pdflash.native.cpu_experts import (
    LEVELS,
    MAX_TOKENS,
    CpuExpertError,
    CpuExperts,
    CpuLevelUnsupported,
    ExpertWeights,
    detect_level,
    supported_levels,
)

try:
    LEVELS_HERE = supported_levels()
except NativeLibraryMissing:  # pragma: no cover - the build is part of the install
    pytest.skip("native library not built", allow_module_level=True)

ALPHA, LIMIT = 1.702, 7.0
CPU_STRESS_SOURCES = ["pf_cpu.c", "pf_layer.c", "pf_relay.c", "pf_sched.c"]  # the library cpu_stress.c links


def transformers_expert(w1, b1, w2, b2, x):
    """transformers' GptOssExperts (float32, one expert, routing weight 1) on x [T, H]."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    H, two_i = w1.shape
    cfg = GptOssConfig(hidden_size=H, intermediate_size=two_i // 2, num_local_experts=1, num_experts_per_tok=1,
                       swiglu_limit=LIMIT)
    m = GptOssExperts(cfg).float()
    assert m.alpha == pytest.approx(ALPHA) and m.limit == LIMIT
    with torch.no_grad():
        m.gate_up_proj.copy_(w1[None].float())
        m.gate_up_proj_bias.copy_((b1 if b1 is not None else torch.zeros(two_i))[None].float())
        m.down_proj.copy_(w2[None].float())
        m.down_proj_bias.copy_((b2 if b2 is not None else torch.zeros(H))[None].float())
        T = x.shape[0]
        return m(x.float(), torch.zeros((T, 1), dtype=torch.long), torch.ones((T, 1)))


def tf_dequant(blocks, scales):
    """transformers' MXFP4 converter, float32, [in, out]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0]


def mxfp4_expert(H, I, seed, scale_lo=119, scale_hi=128, bias_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    gb = torch.randint(0, 256, (2 * I, H // 32, 16), dtype=torch.uint8, generator=g)
    gs = torch.randint(scale_lo, scale_hi, (2 * I, H // 32), dtype=torch.uint8, generator=g)
    db = torch.randint(0, 256, (H, I // 32, 16), dtype=torch.uint8, generator=g)
    ds = torch.randint(scale_lo, scale_hi, (H, I // 32), dtype=torch.uint8, generator=g)
    b1 = torch.randn(2 * I, generator=g).to(bias_dtype) if bias_dtype else None
    b2 = torch.randn(H, generator=g).to(bias_dtype) if bias_dtype else None
    w = ExpertWeights.mxfp4(gb, gs, b1, db, ds, b2, alpha=ALPHA, limit=LIMIT)
    return w, (tf_dequant(gb, gs), b1, tf_dequant(db, ds), b2)


def dense_expert(H, I, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(H, 2 * I, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(I, H, generator=g) / I**0.5).to(dtype)
    b1 = torch.randn(2 * I, generator=g).to(dtype)
    b2 = torch.randn(H, generator=g).to(dtype)
    return ExpertWeights.dense(w1, b1, w2, b2, alpha=ALPHA, limit=LIMIT), (w1, b1, w2, b2)


def check(y, ref):
    """float32 results that differ from the reference only by summation order."""
    assert y.dtype == torch.float32 and y.shape == ref.shape
    tol = 2e-6 * max(1.0, ref.abs().max().item()) * 8
    err = (y - ref).abs().max().item()
    assert err <= tol, f"max abs error {err} > {tol} (max |ref| {ref.abs().max().item()})"
    return err


def test_levels_detected():
    assert LEVELS_HERE[0] == "scalar" and LEVELS_HERE[-1] == detect_level()
    assert set(LEVELS_HERE) <= set(LEVELS)


@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("H,I", [(64, 32), (96, 160), (288, 416)])  # AVX-512 reads 128-element chunks + groups
def test_mxfp4_matches_transformers(level, threads, H, I):
    w, (w1, b1, w2, b2) = mxfp4_expert(H, I, seed=H * 7 + I)
    g = torch.Generator().manual_seed(5)
    with CpuExperts(threads=threads, level=level) as k:
        assert k.level == level and k.threads == threads
        for T in (1, 2, 3, 4, 5, 7, 8, 13, 16):
            x = torch.randn(T, H, generator=g)
            check(k.forward(w, x), transformers_expert(w1, b1, w2, b2, x))


@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("H,I", [(96, 96), (160, 224), (288, 416)])  # chunks of 4 groups + 1..3 left over
def test_mxfp4_bf16_input(level, threads, H, I):
    """bf16 hidden states (the bf16 model): at avx512_bf16 the bf16 dot-product kernel runs for
    every token count, over whole 128-element chunks and the groups left over."""
    w, (w1, b1, w2, b2) = mxfp4_expert(H, I, seed=3 + H)
    g = torch.Generator().manual_seed(6)
    with CpuExperts(threads=threads, level=level) as k:
        for T in (1, 2, 3, 4, 6, 16):
            x = torch.randn(T, H, generator=g).bfloat16()
            check(k.forward(w, x), transformers_expert(w1, b1, w2, b2, x))


@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H,I", [(64, 48), (37, 19), (70, 33)])
def test_dense_matches_transformers(level, dtype, H, I):
    w, (w1, b1, w2, b2) = dense_expert(H, I, seed=H + I, dtype=dtype)
    g = torch.Generator().manual_seed(7)
    for threads in (1, 2, 4):
        with CpuExperts(threads=threads, level=level) as k:
            for T in (1, 2, 5, 8, 9, 16):
                x = torch.randn(T, H, generator=g)
                check(k.forward(w, x), transformers_expert(w1, b1, w2, b2, x))
                check(k.forward(w, x.to(dtype)), transformers_expert(w1, b1, w2, b2, x.to(dtype)))


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_without_biases_and_float32_biases(level):
    H, I = 64, 64
    with CpuExperts(threads=2, level=level) as k:
        for bias_dtype in (None, torch.float32):
            w, (w1, b1, w2, b2) = mxfp4_expert(H, I, seed=9, bias_dtype=bias_dtype)
            x = torch.randn(5, H)
            check(k.forward(w, x), transformers_expert(w1, b1, w2, b2, x))


def test_many_tokens_are_sliced_and_rows_may_be_strided():
    H, I = 64, 32
    w, ref_w = mxfp4_expert(H, I, seed=11)
    wide = torch.randn(40, H + 24)
    x = wide[:, 5 : 5 + H]  # rows H + 24 elements apart
    assert x.stride(0) == H + 24 and x.stride(1) == 1
    with CpuExperts(threads=3) as k:
        out = torch.full((40, H), float("nan"))
        y = k.forward(w, x, out=out)
        assert y is out
        check(y, transformers_expert(*ref_w, x))
        assert x.shape[0] > MAX_TOKENS


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", LEVELS_HERE)
def test_extreme_scales_follow_the_reference(level, x_dtype):
    """Scales 0 (weights 2^-127: subnormal) and 255 (2^128: inf) decode as transformers does;
    the reference's inf / NaN pattern is reproduced (their sums do not depend on order). Blocks
    of 4 rows with and without such scales, so that the bf16 kernel's two chunk loops both run."""
    H, I = 160, 160  # one 128-element chunk and one lone group per row
    g = torch.Generator().manual_seed(12)
    gb = torch.randint(0, 256, (2 * I, H // 32, 16), dtype=torch.uint8, generator=g)
    db = torch.randint(0, 256, (H, I // 32, 16), dtype=torch.uint8, generator=g)
    gs = torch.full((2 * I, H // 32), 127, dtype=torch.uint8)
    gs[::5, 1] = 0
    gs[::7, 4] = 0
    gs[3, 2] = 200  # large finite gate / up values: clamped by the SwiGLU
    ds = torch.full((H, I // 32), 120, dtype=torch.uint8)
    ds[1, 0] = 0
    ds[9, 4] = 0
    ds[7, 2] = 255
    ds[11, 4] = 255
    w = ExpertWeights.mxfp4(gb, gs, None, db, ds, None)
    w1, w2 = tf_dequant(gb, gs), tf_dequant(db, ds)
    assert torch.isinf(w2).any() and (w1.abs() < 2.0**-120).logical_and(w1 != 0).any()
    with CpuExperts(threads=2, level=level) as k:
        x = torch.randn(3, H, generator=g).to(x_dtype)
        y, ref = k.forward(w, x), transformers_expert(w1, None, w2, None, x.float())
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(torch.isposinf(y), torch.isposinf(ref)) and torch.equal(torch.isneginf(y), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    assert not fin.all() and fin.any()  # the inf weights of outputs 7 and 11 reach them, and only them
    check(y[fin], ref[fin])


def test_concurrent_callers_share_one_pool():
    H, I = 64, 96
    w, ref_w = mxfp4_expert(H, I, seed=13)
    xs = [torch.randn(1 + i % MAX_TOKENS, H) for i in range(24)]
    refs = [transformers_expert(*ref_w, x) for x in xs]
    errors = []
    with CpuExperts(threads=3) as k:

        def run(ids):
            try:
                for i in ids:
                    check(k.forward(w, xs[i]), refs[i])
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        ts = [threading.Thread(target=run, args=(range(j, 24, 4),)) for j in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert not errors, errors


def test_argument_errors():
    H, I = 64, 32
    w, _ = mxfp4_expert(H, I, seed=1)
    with pytest.raises(CpuExpertError, match="threads"):
        CpuExperts(threads=0)
    with pytest.raises(CpuExpertError, match="unknown CPU kernel level"):
        CpuExperts(level="sse9")
    with CpuExperts(threads=2) as k:
        with pytest.raises(CpuExpertError, match=r"\[T, 64\]"):
            k.forward(w, torch.randn(2, H + 1))
        with pytest.raises(CpuExpertError, match="float32 or bfloat16"):
            k.forward(w, torch.randn(2, H).half())
        with pytest.raises(CpuExpertError, match="no tokens"):
            k.forward(w, torch.randn(0, H))
        with pytest.raises(CpuExpertError, match="out must be"):
            k.forward(w, torch.randn(2, H), out=torch.empty(2, H, dtype=torch.bfloat16))
        with pytest.raises(CpuExpertError, match="ExpertWeights"):
            k.forward({"gate_up": None}, torch.randn(2, H))
    with pytest.raises(CpuExpertError, match="closed"):
        k.forward(w, torch.randn(2, H))
    k.close()  # idempotent
    gb = torch.zeros(2 * I, H // 32, 16, dtype=torch.uint8)
    gs = torch.zeros(2 * I, H // 32, dtype=torch.uint8)
    db = torch.zeros(H, I // 32, 16, dtype=torch.uint8)
    ds = torch.zeros(H, I // 32, dtype=torch.uint8)
    with pytest.raises(CpuExpertError, match="do not fit"):
        ExpertWeights.mxfp4(gb, gs, None, db[:32], ds[:32], None)
    with pytest.raises(CpuExpertError, match="uint8"):
        ExpertWeights.mxfp4(gb, gs.float(), None, db, ds, None)
    with pytest.raises(CpuExpertError, match="biases"):
        ExpertWeights.mxfp4(gb, gs, torch.zeros(2 * I), db, ds, torch.zeros(H, dtype=torch.bfloat16))
    with pytest.raises(CpuExpertError, match="shape"):
        ExpertWeights.mxfp4(gb, gs, torch.zeros(2 * I + 1), db, ds, None)
    with pytest.raises(CpuExpertError, match="contiguous"):
        ExpertWeights.dense(torch.zeros(2 * I, H).t(), None, torch.zeros(I, H), None)
    with pytest.raises(CpuExpertError, match="float32 or bfloat16"):
        ExpertWeights.dense(torch.zeros(H, 2 * I).half(), None, torch.zeros(I, H).half(), None)


def test_c_api_rejects_bad_calls():
    """The C entry points check their arguments themselves (negative codes, nothing written)."""
    from pdflash.native import _pf_sched

    ffi, lib = _pf_sched.ffi, _pf_sched.lib
    out = ffi.new("pf_cpu **")
    assert lib.pf_cpu_create(0, lib.PF_CPU_LEVEL_AUTO, out) == lib.PF_CPU_EINVAL and out[0] == ffi.NULL
    assert lib.pf_cpu_create(1, 9, out) == lib.PF_CPU_EINVAL
    assert lib.pf_cpu_create(2, lib.PF_CPU_LEVEL_SCALAR, out) == 0
    c = out[0]
    try:
        H, I = 64, 32
        w, _ = mxfp4_expert(H, I, seed=2)
        s = w.struct(ffi)
        x = torch.randn(MAX_TOKENS + 1, H)
        y = torch.full((MAX_TOKENS + 1, H), 7.0)
        xp, yp = ffi.cast("void *", x.data_ptr()), ffi.cast("float *", y.data_ptr())
        assert lib.pf_cpu_expert(c, s, xp, lib.PF_CPU_F32, 0, H, yp) == lib.PF_CPU_EINVAL
        assert lib.pf_cpu_expert(c, s, xp, lib.PF_CPU_F32, MAX_TOKENS + 1, H, yp) == lib.PF_CPU_EINVAL
        assert lib.pf_cpu_expert(c, s, xp, lib.PF_CPU_F32, 1, H - 1, yp) == lib.PF_CPU_EINVAL
        assert lib.pf_cpu_expert(c, s, xp, 7, 1, H, yp) == lib.PF_CPU_EINVAL
        assert lib.pf_cpu_expert(c, s, ffi.NULL, lib.PF_CPU_F32, 1, H, yp) == lib.PF_CPU_EINVAL
        bad = ffi.new("pf_cpu_weights *", s[0])
        bad.hidden = H + 16  # MXFP4 needs multiples of 32
        assert lib.pf_cpu_expert(c, bad, xp, lib.PF_CPU_F32, 1, H + 16, yp) == lib.PF_CPU_EINVAL
        bad = ffi.new("pf_cpu_weights *", s[0])
        bad.down_scales = ffi.NULL
        assert lib.pf_cpu_expert(c, bad, xp, lib.PF_CPU_F32, 1, H, yp) == lib.PF_CPU_EINVAL
        bad = ffi.new("pf_cpu_weights *", s[0])
        bad.bias_format = lib.PF_CPU_MXFP4
        assert lib.pf_cpu_expert(c, bad, xp, lib.PF_CPU_F32, 1, H, yp) == lib.PF_CPU_EINVAL
        assert torch.all(y == 7.0)  # nothing written by refused calls
        assert lib.pf_cpu_expert(c, s, xp, lib.PF_CPU_F32, 2, H, yp) == 0
        assert not torch.all(y[:2] == 7.0) and torch.all(y[2:] == 7.0)
        assert ffi.string(lib.pf_cpu_strerror(lib.PF_CPU_EUNSUPPORTED)) != b"unknown error"
    finally:
        lib.pf_cpu_destroy(c)


def test_unsupported_level_is_refused():
    best = LEVELS.index(detect_level())
    if best == len(LEVELS) - 1:
        from pdflash.native import _pf_sched

        ffi, lib = _pf_sched.ffi, _pf_sched.lib
        out = ffi.new("pf_cpu **")
        assert lib.pf_cpu_create(1, len(LEVELS), out) == lib.PF_CPU_EINVAL  # past the last level
        return
    with pytest.raises(CpuLevelUnsupported, match=LEVELS[best + 1]):
        CpuExperts(level=LEVELS[best + 1])


def test_level_from_environment(monkeypatch):
    monkeypatch.setenv("PDFLASH_CPU_LEVEL", "scalar")
    with CpuExperts(threads=1) as k:
        assert k.level == "scalar"
    monkeypatch.setenv("PDFLASH_CPU_LEVEL", "bogus")
    with pytest.raises(CpuExpertError, match="bogus"):
        CpuExperts(threads=1)


@pytest.mark.skipif(stress_programs.COMPILER is None, reason="no C compiler")
@pytest.mark.parametrize("defines", [(), ("POOL_LINES=1",)], ids=["library", "pool-lines"])
def test_c_stress_quick(tmp_path, defines):
    """native/stress/cpu_stress.c (the Makefile runs it under the sanitizers), built plainly; and
    built as kernel_sweep.sh's POOL_LINES variant (the pool's words on cache lines of their own)."""
    stress_programs.run_quick(tmp_path, "cpu_stress", CPU_STRESS_SOURCES, defines=defines)


@pytest.mark.skipif(stress_programs.COMPILER is None, reason="no C compiler")
@pytest.mark.skipif("avx512_bf16" not in LEVELS_HERE, reason="the software tiles stand in where the bf16 kernels run")
def test_c_stress_quick_with_software_amx_tiles(tmp_path):
    """The same stress test where every bf16 context takes the AMX kernel on software tiles
    (PF_AMX_EMULATE_CONTEXTS, a test build): experts of 4 or more tokens round apart from one-token
    calls there, as on an AMX host, so the checks that compare a batch with single calls bit for bit
    must hold the batch invariance steady between them (on an AMX host the pool phase once
    matched 36 of 40 jobs while another thread toggled it, the GPU check of session 34)."""
    stress_programs.run_quick(tmp_path, "cpu_stress", CPU_STRESS_SOURCES,
                              defines=("PF_AMX_EMULATE", "PF_AMX_EMULATE_CONTEXTS"))


@pytest.mark.skipif(stress_programs.COMPILER is None, reason="no C compiler")
@pytest.mark.skipif("avx512" not in LEVELS_HERE, reason="the AMX kernel's decode needs AVX-512")
def test_amx_kernel_layout_with_software_tiles(tmp_path):
    """native/stress/amx_check.c: the AMX kernel (decode, scale fold, lane transpose, B-tile
    order, partial blocks, the exact fallback) with tile operations emulated in C, against the
    portable kernel, and the batch invariance of whole calls on a context given those tiles
    (pf_cpu_set_invariant: each token of a call the bits of its one-token call; off, the tiles take
    the calls of 4 tokens or more and some result differs). On a CPU with AMX the tests above run
    the real tiles at level amx_bf16."""
    stress_programs.run_quick(tmp_path, "amx_check", [])


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_stream_read_checksum(level):
    """The bandwidth probe really reads every byte: its checksum is the sum of the 64-bit words."""
    g = torch.Generator().manual_seed(21)
    for n in (3, 8, 1000, 4096 + 13, 1 << 20, 5 * 65536 + 40):
        buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        padded = torch.cat([buf, torch.zeros(-n % 8, dtype=torch.uint8)])
        want = sum(int.from_bytes(padded[i : i + 8].numpy().tobytes(), "little") for i in range(0, len(padded), 8)) % 2**64
        for threads in (1, 3):
            with CpuExperts(threads=threads, level=level) as k:
                assert k.stream_read(buf) == want


@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("fmt", ["mxfp4", "dense"])
def test_round_bf16_follows_transformers_in_bf16(level, fmt):
    """round_bf16: the intermediate roundings of transformers' GptOssExperts run in bfloat16.
    Every output is a bf16 value, almost all are transformers' own bit for bit (the float32
    sums differ only in order, so a rounding boundary is rarely crossed), none by more than
    a few bf16 steps."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    H, I = 160, 96
    if fmt == "mxfp4":
        w, (w1, b1, w2, b2) = mxfp4_expert(H, I, seed=31)
        w = ExpertWeights.mxfp4(*(w.tensors[n] for n in ("gate_up", "gate_up_scales", "gate_up_bias", "down",
                                                          "down_scales", "down_bias")), round_bf16=True)
    else:
        _, (w1, b1, w2, b2) = dense_expert(H, I, seed=32, dtype=torch.bfloat16)
        w = ExpertWeights.dense(w1, b1, w2, b2, round_bf16=True)
    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=1, num_experts_per_tok=1)
    m = GptOssExperts(cfg).to(torch.bfloat16)
    with torch.no_grad():
        m.gate_up_proj.copy_(w1[None])
        m.gate_up_proj_bias.copy_(b1[None])
        m.down_proj.copy_(w2[None])
        m.down_proj_bias.copy_(b2[None])
    g = torch.Generator().manual_seed(33)
    x = torch.randn(16, H, generator=g).bfloat16()
    with torch.no_grad():
        ref = m(x, torch.zeros((16, 1), dtype=torch.long), torch.ones((16, 1), dtype=torch.bfloat16)).float()
    with CpuExperts(threads=2, level=level) as k:
        y = k.forward(w, x)
    assert torch.equal(y, y.bfloat16().float())  # bf16 values
    same = (y == ref).float().mean().item()
    ulp = torch.clamp(ref.abs(), min=2.0**-10) * 2.0**-7
    assert same >= 0.97, same
    assert ((y - ref).abs() <= 4 * ulp).all()


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_forward_many_equals_one_call_per_expert(x_dtype):
    """One batched call (a layer's experts) writes, at each destination row, exactly the
    single-expert result times its scale; rows it was not given stay as they were."""
    H = 64
    experts = [mxfp4_expert(H, 64, seed=1)[0], dense_expert(H, 40, seed=2, dtype=torch.bfloat16)[0],
               mxfp4_expert(H, 32, seed=3)[0], dense_expert(H, 24, seed=4, dtype=torch.float32)[0]]
    counts = [3, 1, 16, 5]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, H, generator=g).to(x_dtype)
    total = sum(counts)
    rows = torch.randint(0, 12, (total,), generator=g, dtype=torch.int32)
    dest = torch.randperm(total + 4, generator=g)[:total].to(torch.int32)
    scale = torch.rand(total, generator=g)
    with CpuExperts(threads=3) as k:
        out = torch.full((total + 4, H), 7.0)
        k.forward_many(experts, counts, rows, dest, x, out, scale)
        base = 0
        for w, n in zip(experts, counts):
            r, d = rows[base: base + n].long(), dest[base: base + n].long()
            want = k.forward(w, x[r]) * scale[base: base + n, None]
            assert torch.equal(out[d], want)
            base += n
        untouched = sorted(set(range(total + 4)) - set(dest.tolist()))
        assert torch.equal(out[untouched], torch.full((len(untouched), H), 7.0))
        with pytest.raises(CpuExpertError, match="invalid|argument"):  # a destination row twice
            k.forward_many(experts[:2], [1, 1], rows[:2], torch.tensor([0, 0], dtype=torch.int32), x, out, None)
        with pytest.raises(CpuExpertError, match="rows must be"):
            k.forward_many(experts[:1], [2], rows[:1], dest[:2], x, out, None)
        with pytest.raises(CpuExpertError, match="token counts"):
            k.forward_many(experts[:2], [1], rows[:1], dest[:1], x, out, None)


def test_runner_run_layer_matches_per_expert_loop(tmp_path):
    """CpuExpertRunner.run_layer (one native call) gives the per-expert loop's rows bit for bit."""
    from pdflash.offload.cpu_compute import CpuExpertRunner, CpuRunner
    from pdflash.offload.host_store import HostStore
    from pdflash.offload.runtime import OffloadedModel
    from pdflash.offload.config import ModelPreset
    from pdflash.offload.synthetic import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "m", ModelPreset.from_name("tiny"), mxfp4=True, seed=3)
    rt = OffloadedModel.load(ckpt, device="cpu", dtype="float32", cpu_experts="all")
    try:
        runner = rt.cpu
        assert isinstance(runner, CpuExpertRunner) and isinstance(runner.host, HostStore)
        H = runner.hidden
        T, K = 20, 4
        g = torch.Generator().manual_seed(1)
        x = torch.randn(T, H, generator=g)
        w_flat = torch.rand(T * K, generator=g)
        idx = torch.stack([torch.randperm(runner.host.num_experts, generator=g)[:K] for _ in range(T)])
        positions = {}
        for p, e in enumerate(idx.view(-1).tolist()):
            positions.setdefault(e, []).append(p)
        experts = sorted(positions)
        fast = torch.zeros(T * K, H)
        runner.run_layer(1, experts, positions, K, x, w_flat, fast)
        slow = torch.zeros(T * K, H)
        CpuRunner.run_layer(runner, 1, experts, positions, K, x, w_flat, slow)
        assert torch.equal(fast, slow)
        assert runner.experts == 2 * len(experts)
        # every struct shifted from the first one built is the struct ExpertWeights builds for its row
        ffi = runner.kernel.ffi
        L, E = runner.host.num_layers, runner.host.num_experts
        for layer, e in [(0, 0), (L - 1, E - 1), (0, E - 1), (L - 1, 0), (1, 2)]:
            got, want = runner.struct(layer, e), runner.weights(layer, e).struct(ffi)
            for f in ("format", "bias_format", "hidden", "inter", "alpha", "limit", "round_bf16", "gate_up", "gate_up_scales",
                      "gate_up_bias", "down", "down_scales", "down_bias"):
                a, b = getattr(got, f), getattr(want, f)
                if isinstance(a, (int, float)):
                    assert a == b, (layer, e, f)
                else:
                    assert int(ffi.cast("uintptr_t", a)) == int(ffi.cast("uintptr_t", b)), (layer, e, f)
    finally:
        rt.close()


def test_runner_prices_an_expert_by_its_calibrated_cost_per_token_count(tmp_path, monkeypatch):
    """calibrate() times 1, 2, 4, 8 and 16 tokens; seconds_for(T) follows that curve (interpolated,
    never decreasing, a call per 16 tokens), and the kept-current rate divides a layer call's time
    by its calls' relative costs. A fake clock: a call over T tokens takes 1 + 0.5 (T - 1) ms up
    to 4 tokens, then stays at 2.5 ms (an AMX-like flat cost), with one slow outlier at T = 8."""
    from pdflash.offload import cpu_compute
    from pdflash.offload.config import ModelPreset
    from pdflash.offload.runtime import OffloadedModel
    from pdflash.offload.synthetic import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "m", ModelPreset.from_name("tiny"), mxfp4=True, seed=3)
    rt = OffloadedModel.load(ckpt, device="cpu", dtype="float32", cpu_experts="all")
    try:
        runner = rt.cpu
        now = [0.0]
        monkeypatch.setattr(cpu_compute.time, "perf_counter", lambda: now[0])
        cost_ms = lambda T: 1.0 + 0.5 * (min(T, 4) - 1)  # noqa: E731
        seen = []

        def fake(experts, x):  # one call over several experts: each costs its share
            T = x.shape[0]
            seen.append(T)
            assert len(set(experts)) == len(experts) == runner.calibration_batch
            now[0] += len(experts) * cost_ms(T) * 1e-3 * (3.0 if T == 8 and seen.count(8) == 1 else 1.0)

        monkeypatch.setattr(runner, "_compute_many", fake)
        rate = runner.calibrate(repeats=2)
        assert sorted(set(seen)) == [1, 2, 4, 8, 16]
        assert rate == pytest.approx(runner.expert_bytes / 1e-3)
        assert runner.token_cost == pytest.approx({1: 1.0, 2: 1.5, 4: 2.5, 8: 2.5, 16: 2.5})  # best of 2: the outlier left out
        assert runner.seconds_for(1) == pytest.approx(1e-3)
        assert runner.seconds_for(3) == pytest.approx(2e-3)  # between 2 and 4
        assert runner.seconds_for(16) == pytest.approx(2.5e-3)
        assert runner.seconds_for(20) == pytest.approx(2.5e-3 + 2.5e-3)  # 16 + 4: two calls
        # a layer's call: 3 experts of 1, 2 and 4 tokens in 2x their calibrated time -> half the rate
        K = 4
        positions = {0: [0], 1: [4, 8], 2: [12, 16, 20, 24]}
        x = torch.zeros(7, runner.hidden)
        w_flat = torch.ones(7 * K)
        out = torch.zeros(7 * K, runner.hidden)
        real_forward = runner._forward

        def timed_forward(items, K_, x_, w_, out_):
            counts = real_forward(items, K_, x_, w_, out_)
            now[0] += 2 * sum(cost_ms(c) for c in counts) * 1e-3
            return counts

        monkeypatch.setattr(runner, "_forward", timed_forward)
        runner.rate_bps = None  # the layer call alone sets the rate
        runner.run_layer(0, [0, 1, 2], positions, K, x, w_flat, out)
        assert runner.seconds_for(1) == pytest.approx(2e-3) and runner.seconds_for(4) == pytest.approx(5e-3)
        # a new calibration's curve replaces the last one in every later price: 1 ms more a token up to 4
        monkeypatch.setattr(runner, "_compute_many", fake)
        cost_ms = lambda T: float(min(T, 4))  # noqa: E731
        runner.calibrate(repeats=2)
        assert runner.seconds_for(3) == pytest.approx(3e-3) and runner.seconds_for(16) == pytest.approx(4e-3)
    finally:
        rt.close()


@pytest.mark.parametrize("x_dtype,w_dtype,idx_dtype,T,K", [
    (torch.bfloat16, torch.bfloat16, torch.int64, 5, 4), (torch.float32, torch.float32, torch.int64, 5, 4),
    (torch.float32, torch.bfloat16, torch.int32, 3, 3),  # x's words would start at an odd word: w goes as float32
    (torch.bfloat16, torch.float32, torch.int32, 1, 1)])
def test_routing_and_rows_to_host_in_one_copy_are_bit_exact(x_dtype, w_dtype, idx_dtype, T, K):
    """The hybrid path's one device->host copy packs indices, weights and rows as int16 words:
    unpacked, each is bit for bit the tensor it came from (NaN payloads and signed zeros too),
    in later calls of other sizes as well (the buffers grow and are reused)."""
    from pdflash.offload.host_exchange import HostExchange

    g = torch.Generator().manual_seed(3)
    H = 96
    ex = HostExchange(torch.device("cpu"))
    for t in (T, 2 * T + 1, T):
        idx = torch.randint(0, 128, (t, K), generator=g).to(idx_dtype)
        w = torch.rand((t, K), generator=g).to(w_dtype)
        x = torch.randn((t, H), generator=g).to(x_dtype)
        x[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")], dtype=x_dtype)
        i2, w2, x2 = ex.routing(idx, w, x)
        assert i2.dtype == idx_dtype and torch.equal(i2, idx) and i2.shape == (t, K)
        assert w2.dtype == torch.float32 and torch.equal(w2, w.reshape(-1).float())
        assert x2.dtype == x_dtype and x2.shape == (t, H)
        assert torch.equal(x2.view(torch.int16), x.view(torch.int16))


def test_result_buffer_is_zeroed_when_asked_and_upload_copies_it():
    from pdflash.offload.host_exchange import HostExchange

    ex = HostExchange(torch.device("cpu"))
    buf = ex.result_buffer(8, 16, zero=False)
    buf.fill_(3.0)
    again = ex.result_buffer(4, 16, zero=True)  # the same memory, reused
    assert again.data_ptr() == buf.data_ptr() and again.shape == (4, 16) and not again.any()
    again[1] = 2.5
    up = ex.upload(again)
    assert up.shape == (4, 16) and torch.equal(up, again) and up.data_ptr() != again.data_ptr()


def test_last_timing_accounts_the_phases_of_the_last_call():
    """pf_cpu_last_timing: per phase that ran, published <= first join <= last join <= completed,
    phases in order, no more threads than the pool has; the stream read is phase "read"."""
    w, _ = mxfp4_expert(64, 96, seed=5)
    with CpuExperts(threads=3) as k:
        with pytest.raises(CpuExpertError):
            k.last_timing()
        for tokens in (1, 20):  # 20 rows: two calls of 16 and 4
            k.forward(w, torch.randn(tokens, 64))
            t = k.last_timing()
            assert set(t["phases"]) == {"gate_up", "down"}  # at most 16 rows are prepared on the caller
            prev = 0.0
            for name in ("gate_up", "down"):
                p = t["phases"][name]
                assert 1 <= p["threads"] <= 3
                assert prev <= p["published_us"] <= p["first_join_us"] <= p["last_join_us"] <= p["completed_us"]
                prev = p["completed_us"]
            assert prev <= t["end_us"]
        k.stream_read(torch.zeros(1 << 20, dtype=torch.uint8))
        t = k.last_timing()
        assert set(t["phases"]) == {"read"} and t["phases"]["read"]["threads"] >= 1


def test_prewake_checks_its_argument_and_calls_after_it_compute_the_same():
    """CpuExperts.prewake wakes the pool to poll for the next call: calls made while the threads
    poll (and after the poll ran out) give the results of a pool that was never woken early."""
    w, _ = mxfp4_expert(64, 96, seed=7)
    x = torch.randn(5, 64)
    with CpuExperts(threads=1) as ref:
        want = ref.forward(w, x)
    with CpuExperts(threads=3) as k:
        for bad in (-1, 100_001, 1.5, True, None):
            with pytest.raises(CpuExpertError, match="prewake"):
                k.prewake(bad)
        k.prewake(0)  # nothing to do
        for us in (100_000, 50, 2000):
            k.prewake(us)
            assert torch.equal(k.forward(w, x), want)
        assert k.last_timing()["phases"]["gate_up"]["threads"] >= 1
    with pytest.raises(CpuExpertError, match="closed"):
        k.prewake(10)


def test_a_pool_with_fewer_active_threads_computes_the_same_and_joins_no_more():
    """CpuExperts.set_active: calls of a 4-thread pool with 1..4 active threads give the bits of a
    one-thread pool, no phase is joined by more threads than are active, bad counts are refused,
    and a closed pool says so."""
    w, _ = mxfp4_expert(64, 96, seed=8)
    x = torch.randn(9, 64)
    with CpuExperts(threads=1) as ref:
        want = ref.forward(w, x)
    with CpuExperts(threads=4) as k:
        assert k.active == 4
        for bad in (0, 5, -1, 2.0, True, None):
            with pytest.raises(CpuExpertError, match="set_active"):
                k.set_active(bad)
        for n in (1, 3, 2, 4):
            k.set_active(n)
            assert k.active == n
            k.prewake(200)  # wakes the active ones only
            assert torch.equal(k.forward(w, x), want)
            assert all(p["threads"] <= n for p in k.last_timing()["phases"].values())
    with pytest.raises(CpuExpertError, match="closed"):
        k.set_active(1)


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_batch_invariant_calls_give_each_token_its_one_token_result(level):
    """CpuExperts.set_invariant: while on, every token of a call of 1..16 tokens (bf16 inputs, a
    model rounding like bf16: the inputs the AMX tiles take) gets the bits of its one-token call,
    at every level this CPU runs (amx_bf16 included where it runs: the tiles are off then); off
    again, the calls compute what the default computes; a closed pool says so."""
    H, I = 2880 // 10, 2880 // 10
    w, _ = mxfp4_expert(H, I, seed=12)
    w = ExpertWeights.mxfp4(*(w.tensors[n] for n in ("gate_up", "gate_up_scales", "gate_up_bias", "down",
                                                      "down_scales", "down_bias")), round_bf16=True)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(13)).bfloat16()
    with CpuExperts(threads=2, level=level) as k:
        default = [k.forward(w, x[:T]) for T in range(1, 17)]
        assert k.invariant is False
        k.set_invariant(True)
        assert k.invariant is True
        alone = torch.cat([k.forward(w, x[i:i + 1]) for i in range(16)])
        for T in range(1, 17):
            assert torch.equal(k.forward(w, x[:T]), alone[:T]), f"T = {T}"
        k.set_invariant(False)
        assert k.invariant is False
        for T in (1, 4, 16):
            assert torch.equal(k.forward(w, x[:T]), default[T - 1])
    with pytest.raises(CpuExpertError, match="closed"):
        k.set_invariant(True)


def test_the_runner_gives_steps_without_fetches_every_thread_and_others_their_share(monkeypatch, tmp_path):
    """CpuExpertRunner.share_with_fetches / use_threads: the pool works with the share left
    beside fetches, every thread only inside a use_threads(True) window; no native call when the
    count does not change. A host step of mode "all" runs in such a window and ends it."""
    from pdflash.offload.config import ModelPreset
    from pdflash.offload.graphs import GraphedDecoder
    from pdflash.offload.runtime import OffloadedModel
    from pdflash.offload.synthetic import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "m", ModelPreset.from_name("tiny"), mxfp4=True, seed=26)

    with OffloadedModel.load(ckpt, device="cpu", cpu_experts="all", cpu_threads=3) as rt:
        runner = rt.cpu
        assert runner.fetch_threads == 3 and runner.kernel.active == 3
        runner.share_with_fetches(2)
        assert runner.fetch_threads == 2 and runner.kernel.active == 2
        sets = []
        real = runner.kernel.set_active
        monkeypatch.setattr(runner.kernel, "set_active", lambda n: (sets.append(n), real(n)))
        runner.use_threads(False)
        assert sets == []  # already the share
        runner.use_threads(True)
        runner.use_threads(True)
        assert sets == [3] and runner.kernel.active == 3
        runner.use_threads(False)
        assert sets == [3, 2]
        sets.clear()
        from test_host_graph import _replaying_capture_host  # noqa: E402 (the CPU's stand-in for a captured step)
        from test_batch_invariant import _replaying_capture  # noqa: E402

        monkeypatch.setattr(GraphedDecoder, "_capture_host", _replaying_capture_host)
        monkeypatch.setattr(GraphedDecoder, "_capture", _replaying_capture)
        dec = GraphedDecoder(rt, max_len=12, graphs=False)
        tok = int(dec.prefill([5, 77, 200]).argmax())
        dec.graphs = True
        dec.decode(tok)
        assert rt.cache.stats.host_steps == 1
        assert sets[-2:] == [3, 2] and runner.kernel.active == 2  # the step's window, then the share again
        assert rt.stats()["cpu_experts"]["threads"] == 3 and rt.stats()["cpu_experts"]["fetch_threads"] == 2
        runner.share_with_fetches(99)  # at most the pool
        assert runner.fetch_threads == 3


def test_the_cli_bound_on_cpu_threads_is_the_kernels():
    from pdflash.cli.checks import CPU_THREADS_MAX
    from pdflash.native import _load

    assert CPU_THREADS_MAX == _load()[1].PF_CPU_MAX_THREADS


@pytest.mark.parametrize("cores, workers, want", [(16, 2, (14, 12)), (8, 2, (6, 6)), (32, 2, (30, 28)),
                                                  (64, 4, (62, 58)), (4, 2, (3, 3)), (2, 2, (1, 1)), (1, 2, (1, 1))])
def test_beside_a_gpu_the_kernel_leaves_cores_to_the_copy_workers(cores, workers, want):
    """The default thread counts on CUDA: a pool of every core but two, and beside fetches a core
    fewer for each copy worker, at most a quarter of the cores left out, at least one thread."""
    from pdflash.offload.runtime import gpu_cpu_threads

    pool, fetching = got = gpu_cpu_threads(cores, workers)
    assert got == want and 1 <= fetching <= pool <= cores


# -- Qwen3-MoE's row formats ---------------------------------------------------------------

def qwen3_library_expert(w1, w2, x, dtype):
    """transformers' Qwen3MoeExperts (one expert, routing weight 1) in ``dtype`` on x [T, H]; FP8
    weights come dequantized (offload/qwen3_moe.dequantize_fp8, transformers' arithmetic)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    two_i, H = w1.shape
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=two_i // 2, num_experts=1, num_experts_per_tok=1)
    m = Qwen3MoeExperts(cfg).to(dtype)
    with torch.no_grad():
        m.gate_up_proj.copy_(w1[None])
        m.down_proj.copy_(w2[None])
        T = x.shape[0]
        return m(x.to(dtype), torch.zeros((T, 1), dtype=torch.long), torch.ones((T, 1), dtype=dtype)).float()


def rows_expert(H, I, seed, wdtype, block=None, scale_dtype=torch.float32):
    """A Qwen3-MoE expert as stored (ExpertWeights.rows arguments) and its weights in float32."""
    g = torch.Generator().manual_seed(seed)
    if wdtype != torch.float8_e4m3fn:
        w1, w2 = torch.randn(2 * I, H, generator=g) / H**0.5, torch.randn(H, I, generator=g) / I**0.5
        return (w1.to(wdtype), w2.to(wdtype), None, None), (w1.to(wdtype).float(), w2.to(wdtype).float())
    from pdflash.offload.qwen3_moe import dequantize_fp8

    q1 = (torch.randn(2 * I, H, generator=g) * 16).to(wdtype)
    q2 = (torch.randn(H, I, generator=g) * 16).to(wdtype)
    s1 = ((torch.rand(2 * I // block, H // block, generator=g) + 0.5) / (16 * H**0.5)).to(scale_dtype)
    s2 = ((torch.rand(H // block, I // block, generator=g) + 0.5) / (16 * I**0.5)).to(scale_dtype)
    return (q1, q2, s1, s2), (dequantize_fp8(q1, s1, torch.float32), dequantize_fp8(q2, s2, torch.float32))


ROW_CASES = [  # (H, I, weight dtype, FP8 block): whole vector chunks, odd sizes, blocks of 8 / 16 / 32
    (64, 32, torch.float32, None), (50, 30, torch.bfloat16, None), (96, 160, torch.bfloat16, None),
    (64, 64, torch.float8_e4m3fn, 32), (96, 40, torch.float8_e4m3fn, 8), (160, 48, torch.float8_e4m3fn, 16),
]


@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("H,I,wdtype,block", ROW_CASES)
def test_rows_match_transformers_in_float32(level, threads, H, I, wdtype, block):
    """Qwen3-MoE's experts (bf16 / float32 / FP8 rows, SiLU) in float32: transformers' own
    Qwen3MoeExperts up to summation order, for 1..16 tokens."""
    args, (w1, w2) = rows_expert(H, I, seed=H + I, wdtype=wdtype, block=block)
    w = ExpertWeights.rows(*args)
    g = torch.Generator().manual_seed(5)
    with CpuExperts(threads=threads, level=level) as k:
        for T in (1, 2, 5, 16):
            x = torch.randn(T, H, generator=g)
            check(k.forward(w, x), qwen3_library_expert(w1, w2, x, torch.float32))


@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("wdtype,block,scale_dtype", [(torch.bfloat16, None, None), (torch.float32, None, None),
                                                      (torch.float8_e4m3fn, 32, torch.float32),
                                                      (torch.float8_e4m3fn, 16, torch.bfloat16)])
def test_rows_round_bf16_follows_transformers_in_bf16(level, wdtype, block, scale_dtype):
    """round_bf16 on the row formats: transformers' Qwen3MoeExperts in bfloat16 (weights rounded to
    bf16 as a bf16 model holds them: FP8 dequantized then rounded, float32 rows rounded); every
    output a bf16 value, almost all its own bit for bit, none more than a few bf16 steps away."""
    from pdflash.offload.qwen3_moe import dequantize_fp8

    H, I = 160, 96
    args, _ = rows_expert(H, I, seed=41, wdtype=wdtype, block=block, scale_dtype=scale_dtype or torch.float32)
    w = ExpertWeights.rows(*args, round_bf16=True)
    if wdtype == torch.float8_e4m3fn:
        w1, w2 = dequantize_fp8(args[0], args[2], torch.bfloat16), dequantize_fp8(args[1], args[3], torch.bfloat16)
    else:
        w1, w2 = args[0].bfloat16(), args[1].bfloat16()
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(43)).bfloat16()
    ref = qwen3_library_expert(w1, w2, x, torch.bfloat16)
    with CpuExperts(threads=2, level=level) as k:
        y = k.forward(w, x)
    assert torch.equal(y, y.bfloat16().float())
    same = (y == ref).float().mean().item()
    ulp = torch.clamp(ref.abs(), min=2.0**-10) * 2.0**-7
    assert same >= 0.97, same
    assert ((y - ref).abs() <= 4 * ulp).all()


@pytest.mark.parametrize("level", LEVELS_HERE)
def test_rows_fp8_nan_codes_give_nan_and_many_experts_in_one_call(level):
    """An FP8 NaN code (0x7F or 0xFF) in a gate row makes that token's outputs NaN, as the
    library's dequantized weight does; a layer's call of several row experts equals one call per
    expert."""
    H, I, b = 64, 32, 32
    args, _ = rows_expert(H, I, seed=7, wdtype=torch.float8_e4m3fn, block=b)
    q1 = args[0].clone()
    q1.view(torch.uint8)[3, 5] = 0xFF  # a gate row: h[3] is NaN, so every output is
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(8))
    with CpuExperts(threads=2, level=level) as k:
        for round_bf16 in (False, True):  # the float32 kernels; a bf16 model's (bf16 dot products where they run)
            for T in (2, 6):  # 6 tokens: a bf16 model's rows take the AMX tiles where they run
                assert k.forward(ExpertWeights.rows(q1, *args[1:], round_bf16=round_bf16), x[:T]).isnan().all()
        x = x[:2]
        ws = [ExpertWeights.rows(*rows_expert(H, I, seed=s, wdtype=d, block=b)[0])
              for s, d in ((1, torch.float8_e4m3fn), (2, torch.float8_e4m3fn), (3, torch.float8_e4m3fn))]
        rows = torch.tensor([0, 1, 1, 0], dtype=torch.int32)
        dest = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
        out = torch.zeros(4, H)
        k.forward_many(ws, [2, 1, 1], rows, dest, x, out)
        want = torch.cat([k.forward(ws[0], x[[0, 1]]), k.forward(ws[1], x[[1]]), k.forward(ws[2], x[[0]])])
        assert torch.equal(out, want)


@pytest.mark.parametrize("level", LEVELS_HERE)
@pytest.mark.parametrize("wdtype,block", [(torch.bfloat16, None), (torch.float8_e4m3fn, 32), (torch.float32, None)])
def test_rows_batch_invariant_calls_and_the_tiles_against_the_vector_kernels(level, wdtype, block):
    """A bf16 model's rows (Qwen3-30B-A3B-like proportions, whole tiles and a cut last one): with
    set_invariant on, every token of a 1..16-token call gets its one-token call's bits at every
    level; off, the calls of 4 or more tokens (the AMX tiles where they run) stay within a few bf16
    steps of those, every output a bf16 value."""
    H, I = 224, 96  # 14 tiles of 16 down rows; gate_up grabs of 16 pairs and one of 0 (I = 6 x 16)
    args, _ = rows_expert(H, I, seed=71, wdtype=wdtype, block=block)
    w = ExpertWeights.rows(*args, round_bf16=True)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(72)).bfloat16()
    with CpuExperts(threads=3, level=level) as k:
        k.set_invariant(True)
        alone = torch.cat([k.forward(w, x[i:i + 1]) for i in range(16)])
        for T in (1, 3, 4, 9, 16):
            assert torch.equal(k.forward(w, x[:T]), alone[:T]), f"T = {T}"
        k.set_invariant(False)
        ulp = torch.clamp(alone.abs(), min=2.0**-10) * 2.0**-7
        for T in (4, 9, 16):
            y = k.forward(w, x[:T])
            assert torch.equal(y, y.bfloat16().float())
            assert ((y - alone[:T]).abs() <= 4 * ulp[:T]).all(), f"T = {T}"
            assert (y == alone[:T]).float().mean().item() >= 0.9


def test_rows_argument_errors():
    """Bad row weights are refused in Python with what is wrong; the C checks refuse what slips
    past (a bias, a block that does not divide H)."""
    args, _ = rows_expert(64, 32, seed=9, wdtype=torch.float8_e4m3fn, block=32)
    q1, q2, s1, s2 = args
    with pytest.raises(CpuExpertError, match="block scales"):
        ExpertWeights.rows(q1, q2)
    with pytest.raises(CpuExpertError, match="square blocks"):
        ExpertWeights.rows(q1, q2, torch.ones(3, 2), s2)  # 64 rows in 3 blocks
    with pytest.raises(CpuExpertError, match="must have shape"):
        ExpertWeights.rows(q1, q2, s1[:, :1], s2)
    with pytest.raises(CpuExpertError, match="only FP8"):
        ExpertWeights.rows(q1.float(), q2.float(), s1, s2)
    with pytest.raises(CpuExpertError, match="float32, bfloat16 or float8"):
        ExpertWeights.rows(q1.half(), q2.half())
    with pytest.raises(CpuExpertError, match="do not fit"):
        ExpertWeights.rows(q1[:, :32], q2)
    with pytest.raises(CpuExpertError, match="both be float32 or bfloat16"):
        ExpertWeights.rows(q1, q2, s1, s2.bfloat16())
    w = ExpertWeights.rows(*args)
    with CpuExperts(threads=1) as k:
        ffi = k.ffi
        s = w.struct(ffi)
        bad = ffi.new("pf_cpu_weights *", s[0])
        bad.down_bias = s.gate_up  # row formats take no biases
        with pytest.raises(CpuExpertError):
            k.call_many([bad], [1], [0], [0], [1.0], torch.zeros(1, 64), torch.zeros(1, 64))
        bad = ffi.new("pf_cpu_weights *", s[0])
        bad.block = 48  # does not divide H = 64
        with pytest.raises(CpuExpertError):
            k.call_many([bad], [1], [0], [0], [1.0], torch.zeros(1, 64), torch.zeros(1, 64))
        assert k.forward(w, torch.zeros(1, 64)).abs().sum() == 0  # the context still works
