"""The fused MXFP4 expert kernels (offload/mxfp4_triton.py), run by Triton's CPU interpreter.

Checked against the generic path (dequantize, then matmul), which itself matches transformers:
same results for float32 up to summation order, the same bfloat16 values for bfloat16 (the
kernels round where transformers' module rounds), and batch invariance: a (token, expert) pair's
output does not depend on which other pairs are computed with it.
"""

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need Triton (pip install triton)")

from fused_pairs import assert_batch_invariant, fused_contrib, generic_contrib, runtime_tokens_fused_and_generic  # noqa: E402

from pdflash.offload.gpt_oss import GptOssExpertKernel, mxfp4_expert_layout  # noqa: E402
from pdflash.offload.synthetic import random_mxfp4_slots  # noqa: E402

H, I, E, K, T = 64, 96, 5, 2, 3


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # conftest.py set it before triton was imported
    monkeypatch.setenv("PDFLASH_FUSED_EXPERTS", "1")


def _slots(bias_dtype=torch.bfloat16, seed=0):
    layout = mxfp4_expert_layout(H, I, bias_dtype)
    slots = random_mxfp4_slots(layout, E, seed, scales=(119, 127), bias_std=1.0)
    return layout, slots, torch.Generator().manual_seed(seed + 1)


@pytest.mark.parametrize("dtype,bias_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)])
def test_fused_matches_generic_path(dtype, bias_dtype):
    layout, slots, g = _slots(bias_dtype)
    kernel = GptOssExpertKernel(layout, dtype, 1.702, 7.0, rows_layout=False)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = torch.rand(T * K, generator=g).to(dtype)
    idx = torch.tensor([[0, 3], [4, 0], [2, 1]])
    want = generic_contrib(kernel, slots, x, w, idx)
    got = fused_contrib(kernel, slots, x, w, idx, [list(range(T * K))])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
    else:  # same rounding points; only the float32 summation order differs from the matmul
        assert (got == want).float().mean().item() > 0.97
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * want.float().abs().max().item())


def test_fused_is_batch_invariant():
    layout, slots, g = _slots()
    kernel = GptOssExpertKernel(layout, torch.bfloat16, 1.702, 7.0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T * K, generator=g).to(torch.bfloat16)
    idx = torch.tensor([[1, 3], [3, 0], [2, 4]])
    together = assert_batch_invariant(kernel, slots, x, w, idx)
    # a single token alone gives its rows of the three-token result
    x1 = x[1:2].expand(T, H).contiguous()  # every row is token 1
    alone = fused_contrib(kernel, slots, x1, w, idx, [[2, 3]])
    assert torch.equal(alone[2:4], together[2:4])


def test_a_pair_without_a_slot_gives_a_zero_row_and_leaves_the_others_alone():
    """Slot -1 (the expert is not on the device: host steps' hits and stages) reads no weights
    and gives a zero row; every other pair's row is the one it has alone, bit for bit."""
    layout, slots, g = _slots()
    kernel = GptOssExpertKernel(layout, torch.bfloat16, 1.702, 7.0)
    fused = kernel.fused(torch.device("cpu"))
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T * K, generator=g).to(torch.bfloat16)
    idx = torch.tensor([[1, 3], [3, 0], [2, 4]])
    want = fused_contrib(kernel, slots, x, w, idx, [list(range(T * K))])
    slot = idx.view(-1).clone()
    slot[[0, 3, 4]] = -1
    h = torch.full((T * K, fused.inter), float("nan"), dtype=torch.bfloat16)
    out = torch.full((T * K, H), float("nan"), dtype=torch.bfloat16)
    fused.run(slots, x, w, torch.stack((torch.arange(T * K), slot)).to(torch.int32), h, out, K)
    for p in range(T * K):
        if slot[p] < 0:
            assert torch.equal(out[p], torch.zeros(H, dtype=torch.bfloat16)), p
        else:
            assert torch.equal(out[p], want[p]), p


def test_fused_off_switch_and_dense_experts(monkeypatch):
    layout, _, _ = _slots()
    monkeypatch.setenv("PDFLASH_FUSED_EXPERTS", "0")
    assert GptOssExpertKernel(layout, torch.bfloat16, 1.702, 7.0).fused(torch.device("cpu")) is None
    monkeypatch.setenv("PDFLASH_FUSED_EXPERTS", "1")
    assert GptOssExpertKernel(layout, torch.float16, 1.702, 7.0).fused(torch.device("cpu")) is None
    monkeypatch.delenv("TRITON_INTERPRET")
    assert GptOssExpertKernel(layout, torch.bfloat16, 1.702, 7.0).fused(torch.device("cpu")) is None


def test_runtime_decodes_the_same_tokens_with_the_fused_path(tmp_path, monkeypatch):
    """Tiny MXFP4 model on the CPU: greedy tokens with the fused kernels at the minimum cache
    (misses arrive one by one) equal the generic path's with every expert resident."""
    from pdflash.offload.config import ModelPreset
    from pdflash.offload.synthetic import write_checkpoint

    tiny = ModelPreset.from_name("tiny")
    path = write_checkpoint(tmp_path / "m", tiny, seed=13, mxfp4=True)
    runs = runtime_tokens_fused_and_generic(path, monkeypatch, tiny.num_experts_per_tok)
    assert runs["1"] == runs["0"]
