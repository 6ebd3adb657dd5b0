"""A gpt-oss decoder layer up to its experts in five fused kernels, for decode and verify steps.

transformers' eager GptOssAttention, with its RMSNorms, launches about fifty kernels per layer
for one token (casts, the rotary halves, repeat_kv, the mask add, the sink concatenation, max,
softmax, slices, transposes). Inside a CUDA graph each costs a few microseconds of device time
whatever its size, so on the gpt-oss-120b shape the layers' non-expert part is most of the time
between two layers' experts. Here the same maths runs as:

  1. ``rms_norm``      input_layernorm                                  (one program per row)
  2. q / k / v         the attention module's own nn.Linear (cuBLAS), unchanged
  3. ``rope_kv``       rotary embedding of the query and key heads; keys and values written into
                       the static KV cache at the step's positions
  4. ``attn_decode``   per (row, head): scores against the visible keys, scaling, the additive
                       mask, softmax with the head's sink, times the values (grouped-query heads
                       read their shared key / value head; no repeat_kv copy)
  5. o_proj            nn.Linear, unchanged
  6. ``rms_norm``      residual add and post_attention_layernorm in one kernel
  7. router            the family's own router (linear, top-k, softmax), unchanged

Rounding: in bfloat16 every intermediate is rounded where the eager path rounds it (the rotary
products and sums, q.k, the scaled and masked scores, the shifted scores, each probability, the
output), with float32 accumulation; only the summation order inside a dot product or a row's
sum of squares differs from the eager kernels, so values agree to the last bit or two (the
rotary embedding and the cache writes bit for bit). In float32 they agree to rounding.

Batch invariance: a row's result depends only on that row (one program per row and head), as
with the fused expert kernels.

Used by the gpt-oss family's ``pre_experts`` for steps of at most ``MAX_TOKENS`` rows over the
graphed decoder's static cache; prefill (longer forwards) keeps the library's modules.
``available()``: on CUDA unless ``PDFLASH_FUSED_ATTENTION=0``; on the CPU only through Triton's
interpreter with ``TRITON_INTERPRET=1`` and ``PDFLASH_FUSED_ATTENTION=1`` (the tests).
"""

from __future__ import annotations

import torch

from pdflash.offload.mxfp4_triton import _kernels, triton_available

MAX_TOKENS = 16  # rows of a step the fused layer takes (decode, verify blocks, fixed rows)
BLOCK_KEYS = 64  # keys per loop step of attn_decode


def available(device: torch.device) -> bool:
    """Whether the fused layer can run for tensors on ``device`` (see the module docstring)."""
    return triton_available(device, "PDFLASH_FUSED_ATTENTION")


def supports(layer, x: torch.Tensor, position_embeddings, mask, cache) -> bool:
    """Whether this step of ``layer`` can run fused: a short step over a static cache (graphs.py's
    StaticKV), a compute dtype of bfloat16 or float32, a power-of-two head size and rotary
    tables of half a head."""
    attn = layer.self_attn
    if x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 3 or x.shape[0] != 1:
        return False
    if not 1 <= x.shape[1] <= MAX_TOKENS or not available(x.device):
        return False
    if not (hasattr(cache, "positions") and hasattr(cache, "k") and hasattr(cache, "visible")):
        return False
    hd = attn.head_dim
    cos = position_embeddings[0]
    if hd & (hd - 1) or cos.shape[-1] * 2 != hd or cos.dtype != x.dtype:
        return False
    if mask is None or mask.dim() != 4 or mask.shape[-2] != x.shape[1] or mask.dtype != x.dtype:
        return False
    if mask.shape[-1] != cache.visible or cache.visible > cache.k[attn.layer_idx].shape[2]:
        return False
    return getattr(attn, "sinks", None) is not None and attn.q_proj.weight.dtype == x.dtype


def rms_norm(norm, x: torch.Tensor, add: torch.Tensor | None = None):
    """``norm`` (an RMSNorm module: weight, variance_epsilon) of x [..., H], or of x + add, then
    also returned: y or (x + add, y)."""
    k = _kernels()
    H = x.shape[-1]
    rows = x.numel() // H
    y = torch.empty_like(x)
    xo = torch.empty_like(x) if add is not None else x
    k.rms_norm[(rows,)](x, add if add is not None else x, xo, norm.weight, y, H, float(norm.variance_epsilon),
                        ADD=add is not None, BH=k.triton.next_power_of_2(H), BF16=x.dtype == torch.bfloat16)
    return y if add is None else (xo, y)


def attention(attn, a: torch.Tensor, position_embeddings, mask: torch.Tensor, cache) -> torch.Tensor:
    """GptOssAttention on a [1, T, H] (already normed): writes the step's keys and values into
    ``cache`` at ``cache.positions`` and attends to its first ``cache.visible`` positions through
    ``mask`` [1, 1, T, n_keys]; returns o_proj's output [1, T, H]."""
    out = attend(attn, attn.q_proj(a), attn.k_proj(a), attn.v_proj(a), position_embeddings, mask, cache)
    return attn.o_proj(out)


def attend(attn, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position_embeddings, mask: torch.Tensor,
           cache) -> torch.Tensor:
    """The attention between the projections: q [1, T, heads * hd], key / value [1, T, kv_heads
    * hd] -> [1, T, heads * hd] (rotary, cache writes, scores, softmax with sinks, values)."""
    k = _kernels()
    T = q.shape[1]
    hd = attn.head_dim
    nq, nkv = q.shape[-1] // hd, key.shape[-1] // hd
    bf16 = q.dtype == torch.bfloat16
    kc, vc = cache.k[attn.layer_idx], cache.v[attn.layer_idx]
    cos, sin = (t.reshape(T, hd // 2).contiguous() for t in position_embeddings)
    qr = torch.empty_like(q)
    k.rope_kv[(T, nq + nkv)](q, key, value, cos, sin, cache.positions, qr, kc, vc, nq, nkv, kc.shape[2],
                             HALF=hd // 2, BF16=bf16)
    m = mask.reshape(T, mask.shape[-1])
    if m.stride(-1) != 1:
        m = m.contiguous()
    out = torch.empty_like(q)
    window = int(getattr(attn, "sliding_window", None) or 0)
    k.attn_decode[(T, nq)](qr, kc, vc, m, attn.sinks, out, cache.positions, m.shape[1], m.stride(0), kc.shape[2],
                           float(attn.scaling), nq, nq // nkv, window, D=hd, BN=BLOCK_KEYS, BF16=bf16)
    return out
