"""MXFP4 dequantization against the format's definition and against transformers' converter."""

import pytest
import torch

from pdflash.offload.mxfp4 import FP4_VALUES, dequantize, dequantize_rows, quantize


def _scalar_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Element by element from the definition: [out, G, 16] bytes -> weight [in, out] float64."""
    out_f, groups, _ = blocks.shape
    w = torch.empty(groups * 32, out_f, dtype=torch.float64)
    for o in range(out_f):
        for g in range(groups):
            scale = 2.0 ** (int(scales[o, g]) - 127)
            for b in range(16):
                byte = int(blocks[o, g, b])
                w[g * 32 + 2 * b, o] = FP4_VALUES[byte & 0x0F] * scale  # low nibble = even element
                w[g * 32 + 2 * b + 1, o] = FP4_VALUES[byte >> 4] * scale
    return w


def _random(shape, seed=0, scale_range=(115, 130)):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(scale_range[0], scale_range[1], shape, dtype=torch.uint8, generator=g)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_definition(dtype):
    blocks, scales = _random((6, 3))
    got = dequantize(blocks, scales, dtype)
    assert got.shape == (96, 6) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got.double(), _scalar_reference(blocks, scales))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_converter(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random((4, 40, 3), seed=1)  # [E, out, G]
    assert torch.equal(dequantize(blocks, scales, dtype), convert_moe_packed_tensors(blocks, scales, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_scale_byte_matches_transformers(dtype):
    """All 255 finite E8M0 scales (255 itself encodes NaN) and all 256 code bytes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = (torch.arange(255 * 32) % 256).to(torch.uint8).view(255, 2, 16)  # [out, G, 16]: every byte value
    scales = torch.arange(255, dtype=torch.uint8)[:, None].expand(255, 2).contiguous()
    want = convert_moe_packed_tensors(blocks[None], scales[None], dtype=dtype)[0]
    got = dequantize(blocks, scales, dtype)
    assert torch.equal(got, want)
    assert torch.equal(dequantize_rows(blocks, scales, dtype), want.transpose(0, 1))


def test_non_contiguous_input():
    blocks, scales = _random((4, 6), seed=4)  # stored [G, out, ...]
    b_view, s_view = blocks.transpose(0, 1), scales.transpose(0, 1)  # [out, G, ...] non-contiguous views
    assert not b_view.is_contiguous()
    assert torch.equal(dequantize(b_view, s_view), dequantize(b_view.contiguous(), s_view.contiguous()))


def test_batch_equals_single_experts():
    blocks, scales = _random((5, 16, 2), seed=2)
    batch = dequantize(blocks, scales, torch.bfloat16)
    for e in range(5):
        assert torch.equal(batch[e], dequantize(blocks[e], scales[e], torch.bfloat16))


def test_quantize_roundtrip_is_a_fixed_point():
    w = torch.randn(2, 64, 24) * 0.05
    blocks, scales = quantize(w)
    assert blocks.shape == (2, 24, 2, 16) and scales.shape == (2, 24, 2)
    w1 = dequantize(blocks, scales, torch.float32)
    w2 = dequantize(*quantize(w1), torch.float32)
    assert torch.equal(w1, w2)  # values already on the grid are kept exactly
    # each block's error is at most half the largest grid step (2 x scale) of that block
    step = torch.pow(2.0, scales.float() - 127).repeat_interleave(32, dim=-1).transpose(-1, -2)  # [2, in, out]
    assert bool(((w - w1).abs() <= step + 1e-12).all())


def test_rejects_bad_inputs():
    blocks, scales = _random((4, 2))
    with pytest.raises(TypeError):
        dequantize(blocks.float(), scales)
    with pytest.raises(ValueError):
        dequantize(blocks, scales[:, :1])


@pytest.mark.gpu
def test_cuda_equals_cpu():
    blocks, scales = _random((3, 64, 4), seed=3)
    cpu = dequantize(blocks, scales, torch.bfloat16)
    gpu = dequantize(blocks.cuda(), scales.cuda(), torch.bfloat16)
    assert torch.equal(gpu.cpu(), cpu)


def test_expert_kernel_row_layout_path():
    """The GPU's weight layout ([out, in] rows, transposed views) computes the same experts."""
    from pdflash.offload.gpt_oss import GptOssExpertKernel, mxfp4_expert_layout
    from pdflash.offload.synthetic import random_mxfp4_slots

    H, I, n = 64, 32, 3
    layout = mxfp4_expert_layout(H, I)
    slots = random_mxfp4_slots(layout, 5, seed=5)  # sane scales, small biases
    g = torch.Generator().manual_seed(6)
    x = torch.randn(n, 2, H, generator=g).to(torch.bfloat16)
    ids = [4, 0, 2]
    ref = GptOssExpertKernel(layout, torch.float32, 1.702, 7.0, rows_layout=False)
    rows = GptOssExpertKernel(layout, torch.float32, 1.702, 7.0, rows_layout=True)
    wr, wt = ref.weights(slots, ids), rows.weights(slots, ids)
    assert not wt[0].is_contiguous() and torch.equal(wt[0], wr[0]) and torch.equal(wt[2], wr[2])
    a, b = ref.apply_batched(wr, x.float()), rows.apply_batched(wt, x.float())
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert torch.allclose(rows.apply(wt, 1, x[1].float()), a[1], rtol=1e-5, atol=1e-5)
