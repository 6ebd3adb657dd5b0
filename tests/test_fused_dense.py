"""The fused dense / FP8 expert kernels (offload/dense_triton.py), run by Triton's CPU interpreter.

Checked against the generic path of Qwen3-MoE (qwen3_moe.Qwen3ExpertKernel: gather, dequantize,
matmul), which itself matches transformers: float32 equal up to summation order, bf16 the same
values but for the last bit of a few (the kernels round where transformers' module rounds), and
batch invariance: a (token, expert) pair's output does not depend on what else is computed with it.
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the fused kernels need Triton (pip install triton)")

from fused_pairs import assert_batch_invariant, fused_contrib, generic_contrib, runtime_tokens_fused_and_generic  # noqa: E402

from pdflash.offload.host_store import ExpertLayout  # noqa: E402
from pdflash.offload.qwen3_moe import Qwen3ExpertKernel  # noqa: E402

H, I, E, K, T, B = 64, 96, 5, 2, 3, 32


@pytest.fixture(autouse=True)
def _interpreter(request, monkeypatch):
    """CPU tests: Triton's interpreter (conftest.py set TRITON_INTERPRET before triton was
    imported). GPU tests keep the environment, TRITON_INTERPRET=0 there: compiled kernels."""
    if "gpu" in request.keywords:
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PDFLASH_FUSED_EXPERTS", "1")


def _slots(wdtype, sdtype=torch.float32, seed=0):
    """A Qwen3 expert layout and E random slots: dense weights, or FP8 with B x B block scales."""
    fp8 = wdtype == torch.float8_e4m3fn
    pieces = [("gate_up_proj", (2 * I, H), wdtype), ("down_proj", (H, I), wdtype)]
    if fp8:
        pieces.insert(1, ("gate_up_proj_scale_inv", (2 * I // B, H // B), sdtype))
        pieces.append(("down_proj_scale_inv", (H // B, I // B), sdtype))
    layout = ExpertLayout.build(pieces, quantized=fp8)
    g = torch.Generator().manual_seed(seed)
    slots = torch.zeros(E, layout.expert_bytes, dtype=torch.uint8)
    for p in layout.pieces:
        if p.name.endswith("scale_inv"):
            vals = torch.rand(E, *p.shape, generator=g) * 0.02 + 0.005
        elif fp8:
            vals = (torch.randn(E, *p.shape, generator=g) * 16).clamp(-440, 440)
        else:
            vals = torch.randn(E, *p.shape, generator=g) * 0.1
        view = slots[:, p.offset : p.offset + p.nbytes].view(p.dtype).view(E, *p.shape)
        view.copy_(vals.to(p.dtype))
    return layout, slots, torch.Generator().manual_seed(seed + 1)


@pytest.mark.parametrize("dtype,wdtype,sdtype", [
    (torch.bfloat16, torch.bfloat16, None), (torch.float32, torch.bfloat16, None), (torch.float32, torch.float32, None),
    (torch.bfloat16, torch.float32, None), (torch.bfloat16, torch.float8_e4m3fn, torch.float32),
    (torch.float32, torch.float8_e4m3fn, torch.float32), (torch.bfloat16, torch.float8_e4m3fn, torch.bfloat16),
])
def test_fused_matches_generic_path(dtype, wdtype, sdtype):
    layout, slots, g = _slots(wdtype, sdtype or torch.float32)
    kernel = Qwen3ExpertKernel(layout, dtype, F.silu)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = torch.rand(T * K, generator=g).to(dtype)
    idx = torch.tensor([[0, 3], [4, 0], [2, 1]])
    want = generic_contrib(kernel, slots, x, w, idx)
    got = fused_contrib(kernel, slots, x, w, idx, [list(range(T * K))])
    assert not got.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * want.abs().max().item())
    else:  # same rounding points; only the float32 summation order differs from the matmul
        assert (got == want).float().mean().item() > 0.9
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * want.float().abs().max().item())


def test_fp8_decode_covers_every_byte():
    """Each of the 256 e4m3 bytes (subnormals, both zeros, NaN) decodes to torch's value (float32
    compute, unit scales: h = silu(gate) * up of two decoded bytes, read one column at a time)."""
    layout, slots, _ = _slots(torch.float8_e4m3fn)
    gu, gs = layout.piece("gate_up_proj"), layout.piece("gate_up_proj_scale_inv")
    view = slots[0, gu.offset : gu.offset + gu.nbytes].view(torch.uint8).view(2 * I, H)
    codes = torch.arange(256, dtype=torch.uint8).repeat(2 * I * H // 256 + 1)[: 2 * I * H].view(2 * I, H).clone()
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0  # NaN would poison the dot products; checked below
    codes[I + 5, 3] = 0xFF
    view.copy_(codes)
    slots[0, gs.offset : gs.offset + gs.nbytes].view(torch.float32).fill_(1.0)
    fused = Qwen3ExpertKernel(layout, torch.float32, F.silu).fused(torch.device("cpu"))
    values = codes.view(torch.float8_e4m3fn).float()
    seen = set()
    for c in range(H):  # one-hot x reads column c of every gate and up row
        x = torch.zeros(1, H)
        x[0, c] = 1.0
        h, out = torch.empty(1, I), torch.empty(1, H)
        fused.run(slots, x, torch.ones(1), torch.tensor([[0], [0]], dtype=torch.int32), h, out, 1)
        for r in range(4):  # rows 0-3 hold every byte but the two NaNs
            gate, up = values[r, c], values[I + r, c]
            want = F.silu(gate) * up
            # a wrong bit of the decode is off by 1/8 or more; SiLU's own float32 rounding is 1e-7
            assert abs(h[0, r] - want) <= 1e-6 * abs(want), (r, c, gate, up)
            seen.update((int(codes[r, c]), int(codes[I + r, c])))
        assert h[0, 5].isnan()  # up row I + 5 holds a NaN byte: NaN * 0 is NaN in every column
    assert seen == set(range(256)) - {0x7F, 0xFF}


def test_fused_is_batch_invariant():
    layout, slots, g = _slots(torch.float8_e4m3fn)
    kernel = Qwen3ExpertKernel(layout, torch.bfloat16, F.silu)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T * K, generator=g).to(torch.bfloat16)
    idx = torch.tensor([[1, 3], [3, 0], [2, 4]])
    assert_batch_invariant(kernel, slots, x, w, idx)


def test_fused_is_off_where_it_cannot_compute(monkeypatch):
    layout, _, _ = _slots(torch.bfloat16)
    assert Qwen3ExpertKernel(layout, torch.bfloat16, F.gelu, silu=False).fused(torch.device("cpu")) is None
    assert Qwen3ExpertKernel(layout, torch.float16, F.silu).fused(torch.device("cpu")) is None
    monkeypatch.setenv("PDFLASH_FUSED_EXPERTS", "0")
    assert Qwen3ExpertKernel(layout, torch.bfloat16, F.silu).fused(torch.device("cpu")) is None
    monkeypatch.setenv("PDFLASH_FUSED_EXPERTS", "1")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert Qwen3ExpertKernel(layout, torch.bfloat16, F.silu).fused(torch.device("cpu")) is None


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_runtime_decodes_the_same_tokens_with_the_fused_path(tmp_path, monkeypatch, quant):
    """qwen3-tiny on the CPU in float32: greedy tokens with the fused kernels at the minimum cache
    (misses arrive one by one) equal the generic path's with every expert resident."""
    from pdflash.offload.config import ModelPreset
    from pdflash.offload.synthetic import write_checkpoint

    tiny = ModelPreset.from_name("qwen3-tiny")
    path = write_checkpoint(tmp_path / "m", tiny, seed=13, quant=quant)
    runs = runtime_tokens_fused_and_generic(path, monkeypatch, tiny.num_experts_per_tok, dtype=torch.float32)
    assert runs["1"] == runs["0"]


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_fused_matches_generic_path_at_the_qwen3_shape(wdtype):
    """Compiled kernels on CUDA, Qwen3-30B-A3B expert shape (H 2048, I 768, 128 x 128 FP8 blocks),
    bf16 compute: the fused output equals the generic path's (gather, dequantize, cuBLAS) but for
    the summation order, and one pair alone gives the bits it gives in a batch."""
    from pdflash.offload.family import find_family
    from pdflash.offload.config import SPECIAL_TOKENS, ModelPreset

    quant = "fp8" if wdtype == torch.float8_e4m3fn else None
    ids = {k: i for i, k in enumerate(SPECIAL_TOKENS)}
    fam = find_family(ModelPreset.from_name("qwen3-30b-a3b").hf_config(ids, quant=quant), "qwen3-30b-a3b")
    stored = {"gate_up_proj": wdtype, "down_proj": wdtype}
    if quant:
        stored.update(gate_up_proj_scale_inv=torch.float32, down_proj_scale_inv=torch.float32)
    layout = fam.expert_layout(stored)
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    n_slots, Hs, Is, Ks, Ts = 16, fam.hidden, fam.inter, 8, 2
    slots = torch.zeros(n_slots, layout.expert_bytes, dtype=torch.uint8)
    for p in layout.pieces:
        vals = (torch.rand(n_slots, *p.shape, generator=g) * 0.002 + 0.0005) if p.name.endswith("scale_inv") else \
            (torch.randn(n_slots, *p.shape, generator=g) * (16 if quant else 0.02))
        slots[:, p.offset : p.offset + p.nbytes].view(p.dtype).view(n_slots, *p.shape).copy_(vals.to(p.dtype))
    slots = slots.to(dev)
    kernel = Qwen3ExpertKernel(layout, torch.bfloat16, F.silu)
    fused = kernel.fused(dev)
    assert fused is not None
    x = torch.randn(Ts, Hs, generator=g).to(dev, torch.bfloat16)
    w = torch.rand(Ts * Ks, generator=g).to(dev, torch.bfloat16)
    pairs = torch.randperm(n_slots, generator=g)[: Ts * Ks].tolist()
    weights = kernel.weights(slots, pairs)
    want = torch.stack([(kernel.apply(weights, i, x[p // Ks : p // Ks + 1]) * w[p])[0] for p, i in
                        zip(range(Ts * Ks), range(Ts * Ks))])
    got = torch.empty(Ts * Ks, Hs, dtype=torch.bfloat16, device=dev)
    h = torch.empty(Ts * Ks, Is, dtype=torch.bfloat16, device=dev)
    work = torch.tensor([list(range(Ts * Ks)), pairs], dtype=torch.int32).to(dev)
    fused.run(slots, x, w, work, h, got, Ks)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * want.float().abs().max().item())
    alone = torch.empty_like(got)
    fused.run(slots, x, w, work[:, 5:6].contiguous(), h, alone, Ks)
    assert torch.equal(alone[5], got[5])
