"""The DFlash block-diffusion draft model.

Shape legend: B = block size, C = committed context length (tokens whose target features the draft
has seen), H = hidden size, K = number of target layers read, Hq / Hkv = query / key-value heads,
D = head dim, V = vocabulary.

One draft step fills a block ``[last committed token, MASK x (B-1)]`` placed at positions
``C .. C+B-1`` in a single non-causal forward. Every draft layer attends from the block's queries
to keys / values of ``[projected target context (C) ; block (B)]``, context first, with rotary
positions running over the context and then the block.

The context keys / values of a layer depend only on the projected target features (``fc`` then
``hidden_norm``), never on the block, so they are computed once per committed token and kept in
:class:`DraftKVCache`. The block's own keys / values are transient: the cache only ever holds
committed context, so a rejected block leaves nothing to roll back.

The draft has no embedding or output head of its own: it holds references to the target's
``embed_tokens`` and ``lm_head`` (not registered as submodules, so they stay out of the draft's
state_dict and are never copied or moved by it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdflash import PdflashError
from pdflash.draft.config import DFlashConfig, TargetShape


class RMSNorm(nn.Module):
    """Qwen3-style RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [1, h, T, D]; cos / sin [1, T, D]
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class DraftKVCache:
    """Per-layer keys / values of the committed context, [1, Hkv, capacity, D] buffers filled in place.

    Invariant: positions 0 .. length-1 hold the context of committed tokens 0 .. length-1.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, device, dtype, capacity: int = 256):
        self.length = 0
        self._shape = (num_layers, 1, kv_heads, capacity, head_dim)
        self.keys = torch.empty(self._shape, device=device, dtype=dtype)
        self.values = torch.empty(self._shape, device=device, dtype=dtype)

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more tokens (doubling, so appends stay amortised O(1))."""
        need = self.length + extra
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:3], new_cap, old.shape[4]))
            new[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, new)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k / v [1, Hkv, n, D] at positions length .. length+n-1 (``advance`` commits them)."""
        n = k.shape[2]
        self.keys[layer, :, :, self.length : self.length + n] = k
        self.values[layer, :, :, self.length : self.length + n] = v

    def advance(self, n: int) -> None:
        self.length += n

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed k / v of one layer, views [1, Hkv, length, D]."""
        return self.keys[layer, :, :, : self.length], self.values[layer, :, :, : self.length]

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a draft cache of length {self.length} to {length}")
        self.length = length


class DraftAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=config.attention_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)  # per head, over D
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [1, T, H] -> k, v [1, Hkv, T, D]; k is k-normed then rotated."""
        t = x.shape[1]
        k = self.k_norm(self.k_proj(x).view(1, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(1, t, self.n_kv, self.head_dim).transpose(1, 2)
        return _apply_rotary(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # [1, B, H] block, after input_layernorm
        cos: torch.Tensor,  # [1, B, D] block positions
        sin: torch.Tensor,
        ctx_k: torch.Tensor,  # [1, Hkv, C, D]
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None,  # [B, C+B] bool (True = attend) for sliding layers, else None
    ) -> torch.Tensor:
        b = x.shape[1]
        q = self.q_norm(self.q_proj(x).view(1, b, self.n_heads, self.head_dim)).transpose(1, 2)
        q = _apply_rotary(q, cos, sin)  # [1, Hq, B, D]
        blk_k, blk_v = self.keys_values(x, cos, sin)
        k = torch.cat((ctx_k, blk_k), dim=2)  # [1, Hkv, C+B, D]
        v = torch.cat((ctx_v, blk_v), dim=2)
        groups = self.n_heads // self.n_kv
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)  # [1, Hq, C+B, D]
            v = v.repeat_interleave(groups, dim=1)
        attn_mask = None if mask is None or self.sliding_window is None else mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False)  # [1, Hq, B, D]
        return self.o_proj(out.transpose(1, 2).reshape(1, b, self.n_heads * self.head_dim))


class DraftMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """DFlash drafter sharing the target's ``embed_tokens`` and ``lm_head``.

    Usage per step (C = ``context_length``):
        model.append_context(features)          # [1, n, K*H] target features of newly committed tokens
        hidden = model(block_ids, start=C)       # [1, B, H], block_ids = [last token, MASK ...]
        logits = model.head(hidden[:, 1:])       # [1, B-1, V] proposals for positions C+1 .. C+B-1
    """

    def __init__(self, config: DFlashConfig, embed_tokens: nn.Embedding, lm_head: nn.Module):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        # Rotary tables live with the target's embeddings even when the layers are built on meta.
        with torch.device(embed_tokens.weight.device):
            self.rotary_emb = _make_rotary(config)
        self._shared = (embed_tokens, lm_head)  # a tuple: not registered, not in state_dict
        self.cache: DraftKVCache | None = None

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._shared[1]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's output head over draft hidden states [..., H] (cast to the head's dtype:
        the draft may compute in another, e.g. float32 on a CPU) -> logits [..., V]."""
        w = getattr(self.lm_head, "weight", None)
        rows = _rows(hidden)
        logits = self.lm_head(rows if w is None else rows.to(w.dtype))
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    @property
    def context_length(self) -> int:
        return 0 if self.cache is None else self.cache.length

    def reset_context(self) -> None:
        """Forget all committed context (start of a new sequence)."""
        self.cache = None

    def _rotary(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(like, positions[None])  # cos, sin [1, T, D]

    @torch.no_grad()
    def append_context(self, features: torch.Tensor) -> None:
        """Project the target features [1, n, K*H] of the next n committed tokens into every layer's K/V."""
        if features.dim() != 3 or features.shape[0] != 1 or features.shape[2] != self.fc.in_features:
            raise ValueError(f"expected target features [1, n, {self.fc.in_features}], got {tuple(features.shape)}")
        n = features.shape[1]
        if n == 0:
            return
        w = self.fc.weight
        if self.cache is None:
            cfg = self.config
            self.cache = DraftKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, w.device, w.dtype)
        ctx = self.hidden_norm(self.fc(_rows(features).to(device=w.device, dtype=w.dtype)))[None]  # [1, n, H]
        pos = torch.arange(self.cache.length, self.cache.length + n, device=w.device)
        cos, sin = self._rotary(pos, ctx)
        self.cache.reserve(n)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(ctx, cos, sin)
            self.cache.write(i, k, v)
        self.cache.advance(n)

    @torch.no_grad()
    def forward(self, block_ids: torch.Tensor, start: int) -> torch.Tensor:
        """block_ids [1, B] at positions start .. start+B-1 -> final hidden states [1, B, H].

        ``start`` must equal ``context_length``: the block begins right after the committed context.
        """
        if start != self.context_length:
            raise ValueError(f"block starts at {start} but the draft holds {self.context_length} context positions")
        w = self.fc.weight
        b = block_ids.shape[1]
        x = self.embed_tokens(block_ids.to(self.embed_tokens.weight.device)).to(device=w.device, dtype=w.dtype)
        pos = torch.arange(start, start + b, device=w.device)
        cos, sin = self._rotary(pos, x)
        mask = None
        if self.config.sliding_window is not None and "sliding_attention" in self.config.layer_types:
            key_pos = torch.arange(0, start + b, device=w.device)
            mask = (pos[:, None] - key_pos[None, :]) < self.config.sliding_window  # [B, C+B]
        for i, layer in enumerate(self.layers):
            if self.cache is None:
                empty = x.new_empty((1, self.config.num_key_value_heads, 0, self.config.head_dim))
                ctx_k, ctx_v = empty, empty
            else:
                ctx_k, ctx_v = self.cache.get(i)
            x = layer(x, cos, sin, ctx_k, ctx_v, mask)
        return self.norm(x)

    @torch.no_grad()
    def warm_up(self, lengths) -> None:
        """For each length n: append n tokens of zero features to an empty context, draft a block
        of n after them and run the proposals' head; then forget that context. The first call of
        each shape pays the CPU library's setup for it, here instead of in a decode step."""
        saved = self.cache
        w = self.fc.weight
        for n in sorted(set(int(b) for b in lengths if int(b) >= 2)):
            self.cache = None
            self.append_context(w.new_zeros((1, n, self.fc.in_features)))
            self.head(self(self.block_ids(0, n, w.device), n)[:, 1:])
        self.cache = saved

    def block_ids(self, last_token: int, block_size: int, device) -> torch.Tensor:
        """[1, B] = [last_token, MASK x (B-1)]."""
        ids = torch.full((1, block_size), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = last_token
        return ids


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., F] as 2-D rows [N, F]. A slice such as ``hidden[:, 1:]`` of a [1, T, F] tensor keeps
    the stride of its size-1 leading dimension, and PyTorch's CPU linear takes a path several
    times slower for such an input (0.4 against 0.1 ms for the embedded model's head); the
    2-D view has the plain strides."""
    return x.reshape(-1, x.shape[-1])


def _make_rotary(config: DFlashConfig) -> nn.Module:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    qcfg = Qwen3Config(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        num_hidden_layers=config.num_hidden_layers,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=dict(config.rope_parameters),
    )
    return Qwen3RotaryEmbedding(qcfg)


# -- loading ------------------------------------------------------------------------------------


def draft_tensor_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape for ``config`` (built on the meta device, no memory)."""
    with torch.device("meta"):
        model = DFlashDraftModel(config, nn.Embedding(config.vocab_size, config.hidden_size), nn.Identity())
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards named by ``model.safetensors.index.json``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PdflashError(f"draft index {str(index)!r} is malformed ({exc})") from None
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise PdflashError(f"draft directory {str(path)!r} has no model.safetensors (or index); is it a DFlash checkpoint?")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            tensors.update(load_file(str(path / name), device="cpu"))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise PdflashError(f"draft weights {str(path / name)!r} cannot be read ({exc}); re-download or regenerate them") from None
    return tensors


def load_draft(
    draft_dir: str | Path,
    target: nn.Module,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> DFlashDraftModel:
    """Load a DFlash checkpoint directory as a draft for ``target`` (a transformers causal LM
    with ``.config``, ``.model.embed_tokens`` and ``.lm_head``).

    Weights land on ``device`` (default: the target embeddings' device) in ``dtype`` (default: the
    target embeddings' dtype, so target features and draft weights agree). Raises PdflashError for a
    missing / malformed checkpoint or a draft that does not fit the target.
    """
    path = Path(draft_dir)
    config = DFlashConfig.from_dir(path)
    config.check_fits(TargetShape.from_config(target.config))
    embed, lm_head = target.model.embed_tokens, target.lm_head
    device = torch.device(device) if device is not None else embed.weight.device
    dtype = dtype or embed.weight.dtype
    tensors = read_safetensors_dir(path)
    expected = draft_tensor_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}")
        raise PdflashError(f"draft weights in {str(path)!r} do not match its config: {'; '.join(parts)}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise PdflashError(f"draft tensor {name} has shape {tuple(tensors[name].shape)}, config says {shape}")
    with torch.device("meta"):
        model = DFlashDraftModel(config, embed, lm_head)
    state = {name: t.to(device=device, dtype=dtype) for name, t in tensors.items()}
    model.load_state_dict(state, assign=True, strict=True)
    if model.rotary_emb.inv_freq.device != device:
        model.rotary_emb.to(device)
    model.eval().requires_grad_(False)
    return model
