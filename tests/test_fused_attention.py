"""The fused gpt-oss layer (offload/attn_triton.py), run by Triton's CPU interpreter, against the
library's modules: the same logits up to summation order in float32, nearly all keys and values
in the cache the same bits and the same greedy tokens in bfloat16, for decode steps, verify
blocks, fixed rows and sliding-window layers. On the CPU through the interpreter (conftest.py
sets TRITON_INTERPRET=1); the GPU test runs the compiled kernels inside CUDA graphs."""

import pytest
import torch

pytest.importorskip("triton", reason="the fused kernels need Triton (pip install triton)")

from pdflash.offload import attn_triton  # noqa: E402
from pdflash.offload.config import ModelPreset  # noqa: E402
from pdflash.offload.graphs import GraphedDecoder  # noqa: E402
from pdflash.offload.runtime import OffloadedModel  # noqa: E402
from pdflash.offload.synthetic import write_checkpoint  # noqa: E402

TINY = ModelPreset.from_name("tiny")
PROMPT = [5, 77, 200, 31, 9, 100, 250, 17, 3, 44, 81, 90, 12, 60, 8, 140, 33, 2]  # past the window (8), and a
# prefill longer than a verify block (attn_triton.MAX_TOKENS): the library's modules run it


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fattn")
    return {dt: write_checkpoint(root / dt, TINY, seed=21, dtype=dt) for dt in ("float32", "bfloat16")}


@pytest.fixture(params=["float32", "bfloat16"])
def ckpt(request, ckpts):
    return ckpts[request.param]


def _run(rt, monkeypatch, fused: bool, rows=None, blocks=(1, 3, 2)):
    """Prefill, then steps of the given lengths (greedy continuation fed back as the block's
    tokens): every step's logits, the tokens, the KV cache, and how many fused layers ran."""
    monkeypatch.setenv("PDFLASH_FUSED_ATTENTION", "1" if fused else "0")
    calls = []
    real = attn_triton.attention
    monkeypatch.setattr(attn_triton, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    dec = GraphedDecoder(rt, max_len=40, graphs=False, rows=rows)
    logits = dec.prefill(PROMPT)
    toks, outs = [int(logits.argmax())], [logits]
    for T in blocks:
        block = [toks[-1]] * T
        lg, _ = dec.forward(block)
        outs.append(lg)
        toks.append(int(lg[-1].argmax()))
    return outs, toks, dec.kv, len(calls)


@pytest.mark.parametrize("dtype,rows,block", [("float32", None, 64), ("bfloat16", None, 64), ("bfloat16", 4, 64),
                                              ("float32", None, 4)],
                         ids=["f32", "bf16", "bf16-fixed-rows", "f32-short-key-blocks"])
def test_fused_layer_matches_the_library_modules(ckpts, monkeypatch, dtype, rows, block):
    """``block`` keys a loop step: with 4, the sliding layers (window 8) skip the key blocks
    wholly before their window, as long sequences do with the default."""
    monkeypatch.setattr(attn_triton, "BLOCK_KEYS", block)
    with OffloadedModel.load(ckpts[dtype]) as rt:
        want, want_toks, want_kv, n0 = _run(rt, monkeypatch, fused=False, rows=rows)
        got, got_toks, got_kv, n1 = _run(rt, monkeypatch, fused=True, rows=rows)
    assert n0 == 0 and n1 == 3 * TINY.num_hidden_layers  # every layer of every step ran fused; the prefill did not
    assert got_toks == want_toks
    f32 = rt.dtype == torch.float32
    for g, w in zip(got, want):
        if f32:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        else:  # same rounding points; summation order differs in the dot products and norms
            torch.testing.assert_close(g, w, rtol=0.05, atol=0.05 * w.abs().max().item())
    n = len(PROMPT) + 6
    for layer in range(TINY.num_hidden_layers):
        for g, w in ((got_kv.k[layer][:, :, :n], want_kv.k[layer][:, :, :n]), (got_kv.v[layer][:, :, :n], want_kv.v[layer][:, :, :n])):
            if f32:
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            else:
                assert (g == w).float().mean().item() > (0.99 if layer == 0 else 0.9)
                torch.testing.assert_close(g.float(), w.float(), rtol=0.05, atol=0.05 * w.float().abs().max().item())

def test_fused_kernels_are_batch_invariant(ckpt, monkeypatch):
    """The norm, rotary and attention kernels compute each row alone: row 0 of a three-row call
    equals the same row computed by itself (the projections between them are the library's)."""
    monkeypatch.setenv("PDFLASH_FUSED_ATTENTION", "1")
    with OffloadedModel.load(ckpt) as rt:
        layer = rt.family.decoder_layers(rt.model)[1]
        attn, dt, H = layer.self_attn, rt.dtype, TINY.hidden_size
        g = torch.Generator().manual_seed(3)
        x = torch.randn(1, 3, H, generator=g).to(dt)
        q, key, value = (torch.randn(1, 3, p.out_features, generator=g).to(dt) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        keys = torch.randn(1, key.shape[-1] // attn.head_dim, 40, attn.head_dim, generator=g).to(dt)
        norms, outs = [], []
        for n in (1, 3):
            norms.append(attn_triton.rms_norm(layer.input_layernorm, x[:, :n].contiguous())[0, 0])
            dec = GraphedDecoder(rt, max_len=40, graphs=False)
            dec.kv.k[1].copy_(keys)
            dec.kv.v[1].copy_(keys.flip(-1))
            dec.kv.positions, dec.kv.visible = torch.arange(20, 20 + n), 24
            mask = torch.zeros(1, 1, n, 24, dtype=dt)
            mask[..., 21:] = torch.finfo(dt).min  # row 0 sees positions 0 .. 20
            pe = (dec.cos[:, 20:20 + n], dec.sin[:, 20:20 + n])
            rows = [t[:, :n].contiguous() for t in (q, key, value)]
            outs.append(attn_triton.attend(attn, *rows, pe, mask, dec.kv)[0, 0])
        assert torch.equal(norms[0], norms[1]) and torch.equal(outs[0], outs[1])


def test_unsupported_steps_keep_the_library_modules(ckpt, monkeypatch):
    monkeypatch.setenv("PDFLASH_FUSED_ATTENTION", "1")
    with OffloadedModel.load(ckpt) as rt:
        layer = rt.family.decoder_layers(rt.model)[0]
        dec = GraphedDecoder(rt, max_len=40, graphs=False)
        x = torch.zeros(1, attn_triton.MAX_TOKENS + 1, TINY.hidden_size, dtype=rt.dtype)
        pe = (dec.cos[:, :x.shape[1]], dec.sin[:, :x.shape[1]])
        dec.kv.visible = 20
        mask = torch.zeros(1, 1, x.shape[1], 20, dtype=rt.dtype)
        assert not attn_triton.supports(layer, x, pe, mask, dec.kv)  # longer than a verify block: a prefill
        assert attn_triton.supports(layer, x[:, :2], (pe[0][:, :2], pe[1][:, :2]), mask[:, :, :2], dec.kv)
        assert not attn_triton.supports(layer, x[:, :2], (pe[0][:, :2], pe[1][:, :2]), mask[:, :, :2], None)
        monkeypatch.setenv("PDFLASH_FUSED_ATTENTION", "0")
        assert not attn_triton.supports(layer, x[:, :2], (pe[0][:, :2], pe[1][:, :2]), mask[:, :, :2], dec.kv)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_fused_layer_matches_the_library_modules(tmp_path, monkeypatch, dtype):
    """Compiled kernels captured in CUDA graphs: the same greedy tokens as the library's modules
    in the same graphs, float32 logits equal up to summation order."""
    path = write_checkpoint(tmp_path / "m", TINY, seed=22, dtype=dtype)
    runs = []
    real = attn_triton.attention
    with OffloadedModel.load(path, device="cuda") as rt:
        for fused in (False, True):
            monkeypatch.setenv("PDFLASH_FUSED_ATTENTION", "1" if fused else "0")
            calls = []
            monkeypatch.setattr(attn_triton, "attention", lambda *a, calls=calls, **k: calls.append(1) or real(*a, **k))
            dec = GraphedDecoder(rt, max_len=64, graphs=True)
            logits = [dec.prefill(PROMPT)]
            toks = [int(logits[-1].argmax())]
            for _ in range(16):
                logits.append(dec.decode(toks[-1]))
                toks.append(int(logits[-1].argmax()))
            runs.append((toks, logits, len(calls)))
    assert runs[0][2] == 0 and runs[1][2] > 0
    assert runs[0][0] == runs[1][0]
    if dtype == "float32":
        for g, w in zip(runs[1][1], runs[0][1]):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
