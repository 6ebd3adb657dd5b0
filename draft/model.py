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

On a CPU, a small float32 draft runs each pass as one native call (``use_native``: the
``pf_draft`` kernel in pdflash/native, checked against this module's operators), since its
operators cost far more in per-call overhead than in arithmetic; ``propose`` takes the greedy
proposals there too.

The draft has no embedding or output head of its own: it holds references to the target's
``embed_tokens`` and ``lm_head`` (not registered as submodules, so they stay out of the draft's
state_dict and are never copied or moved by it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pdflash import PdflashError
from pdflash.draft.config import DFlashConfig, TargetShape

# A pass of more rows than this (the first step after a long prompt appends its whole context)
# runs as PyTorch operators, whose products use every intra-op thread; the native pass is one
# thread. Embedded draft, appending n rows and drafting 4 (2-vCPU VM): n = 256 native 2.6-2.9 ms
# against the operators' 3.3-4.6 (1-2 threads); n = 1024 native 9.5-12.9 against 8.1-13.0.
NATIVE_MAX_ROWS = 256


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
    # x [1, h, T, D]; cos / sin [1, T, D] (the training script's form)
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, h, D] with cos / signed_sin [T, 1, D]: rotate_half(x) * sin is
    roll(x, D/2) * sin with the first half of sin negated, two operations fewer."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin


class _Held:
    """Parameters read outside their modules (a stacked product, the native pass), as they were
    when recorded: ``intact()`` is False once any was reassigned or had its storage swapped
    (``Module.to`` replaces a parameter's data in place, hence the data pointer as well as the object)."""

    def __init__(self, modules: Sequence[nn.Module] = (), names: Sequence[str] = ("weight", "bias")):
        self._held: list[tuple[dict, str, torch.Tensor | None, int | None]] = []
        for module in modules:
            for name in names:
                self.add(module, name)

    def add(self, module: nn.Module, name: str) -> torch.Tensor | None:
        """Record ``module.<name>`` (a parameter, or None); returns it."""
        t = getattr(module, name)
        self._held.append((module._parameters, name, t, None if t is None else t.data_ptr()))
        return t

    def intact(self) -> bool:
        for params, name, t, ptr in self._held:
            if params.get(name) is not t or (t is not None and t.data_ptr() != ptr):
                return False
        return True


class _Stacked:
    """Linear layers that read the same input, run as one product.

    Built by the layers' ``pack()``, it lays their weights (and biases) out as row views of one
    tensor, so the stacked product needs no memory of its own. If any layer no longer holds the view it was given (the
    model was moved or converted, or a weight was reassigned), calls fall back to the separate
    layers, so the result never depends on a stale copy.
    """

    def __init__(self, linears: Sequence[nn.Linear]):
        self.linears = list(linears)
        self.sizes = [lin.out_features for lin in self.linears]
        biased = [lin.bias is not None for lin in self.linears]
        if any(biased) and not all(biased):
            raise ValueError("stacked linears need a bias on all or none")
        with torch.no_grad():
            self.weight = torch.cat([lin.weight.detach() for lin in self.linears])
            self.bias = torch.cat([lin.bias.detach() for lin in self.linears]) if all(biased) else None
        row = 0
        for lin, n in zip(self.linears, self.sizes):
            lin.weight = nn.Parameter(self.weight[row : row + n], requires_grad=lin.weight.requires_grad)
            if self.bias is not None:
                lin.bias = nn.Parameter(self.bias[row : row + n], requires_grad=lin.bias.requires_grad)
            row += n
        self._held = _Held(self.linears)

    def intact(self) -> bool:
        """Every layer still holds the view it was given."""
        return self._held.intact()

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.intact():
            return list(F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))
        return [lin(x) for lin in self.linears]


class DraftKVCache:
    """Per-layer keys / values, [1, Hkv, capacity, D] buffers filled in place.

    Invariant: positions 0 .. length-1 hold the context of committed tokens 0 .. length-1.
    Positions from ``length`` on are scratch: a draft step writes its new context there (then
    ``advance`` commits it) and its block's transient keys / values after that.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, device, dtype, capacity: int = 256,
                 zeroed: bool = False):
        self.length = 0
        self._shape = (num_layers, 1, kv_heads, capacity, head_dim)
        make = torch.zeros if zeroed else torch.empty  # zeroed: positions never written hold finite values
        self.keys = make(self._shape, device=device, dtype=dtype)
        self.values = make(self._shape, device=device, dtype=dtype)

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` positions after ``length`` (doubling, so appends stay amortised O(1))."""
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

    def get(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """k / v of one layer up to ``end`` (default: the committed length), views [1, Hkv, end, D]."""
        end = self.length if end is None else end
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

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
        self._qkv: _Stacked | None = None  # set by pack()

    def pack(self) -> None:
        self._qkv = _Stacked([self.q_proj, self.k_proj, self.v_proj])

    def _project(self, rows: torch.Tensor) -> list[torch.Tensor]:
        if self._qkv is not None:
            return self._qkv(rows)
        return [self.q_proj(rows), self.k_proj(rows), self.v_proj(rows)]

    def forward(self, rows: torch.Tensor, n_ctx: int, cos: torch.Tensor, signed_sin: torch.Tensor,
                cache: DraftKVCache, layer: int, mask: torch.Tensor | None) -> torch.Tensor | None:
        """rows [n_ctx + B, H]: the new context (projected target features) then the block (after
        input_layernorm), at positions cache.length .. ; cos / signed_sin [n_ctx + B, 1, D].
        Writes every row's keys / values into the cache from its length on (the context's stay
        once the caller advances it; the block's are scratch), then attends from the block's
        rows to all keys up to the block's end. Returns the block's output [B, H] (None for B = 0)."""
        t, d = rows.shape[0], self.head_dim
        b = t - n_ctx
        q, k, v = self._project(rows)
        k = _rotate(self.k_norm(k.view(t, self.n_kv, d)), cos, signed_sin)
        cache.write(layer, k.transpose(0, 1)[None], v.view(t, self.n_kv, d).transpose(0, 1)[None])
        end = cache.length + t
        if b == 0:
            return None
        q = _rotate(self.q_norm(q[n_ctx:].view(b, self.n_heads, d)), cos[n_ctx:], signed_sin[n_ctx:])
        keys, values = cache.get(layer, end)
        attn_mask = None if mask is None or self.sliding_window is None else mask
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=attn_mask,
                                             enable_gqa=self.n_heads != self.n_kv)  # [1, Hq, B, D]
        return self.o_proj(out[0].transpose(0, 1).reshape(b, self.n_heads * d))


class DraftMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self._gate_up: _Stacked | None = None  # set by pack()

    def pack(self) -> None:
        self._gate_up = _Stacked([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is not None:
            gate, up = self._gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DraftLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def forward(self, ctx: torch.Tensor, x: torch.Tensor, cos, signed_sin, cache: DraftKVCache, layer: int, mask):
        """ctx [n, H] new context rows, x [B, H] the block -> the block after this layer."""
        n = ctx.shape[0]
        rows = self.input_layernorm(x) if n == 0 else torch.cat((ctx, self.input_layernorm(x)))
        x = x + self.self_attn(rows, n, cos, signed_sin, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """DFlash drafter sharing the target's ``embed_tokens`` and ``lm_head``.

    Usage per step (C = ``context_length``):
        hidden = model(block_ids, start=C + n, context=features)  # features [1, n, K*H] of the n
                                                # newly committed tokens; block_ids = [last token, MASK ...]
        logits = model.head(hidden[:, 1:])       # [1, B-1, V] proposals for positions C+n+1 .. C+n+B-1
    ``append_context(features)`` adds context without a block (the same projection).
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
        self._native = None  # a pdflash.native.draft_pass.DraftPass over these weights (use_native)
        self._native_held = _Held()  # the parameters the native pass reads
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos / sin [P, D] by position
        self._graphs = None  # a pdflash.draft.graphed.DraftGraphs: static-cache passes (use_graphs)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._shared[1]

    def pack(self) -> "DFlashDraftModel":
        """Stack each layer's q / k / v and gate / up weights so each group is one product in
        inference (the weights become row views of the stacked tensors: no extra memory, the
        state_dict unchanged). load_draft calls it; training reads the separate layers as ever."""
        for layer in self.layers:
            layer.self_attn.pack()
            layer.mlp.pack()
        return self

    def use_native(self, enable: bool = True, level: str | None = None) -> bool:
        """From now on run passes (and greedy proposals) through the native CPU draft pass
        (``pdflash/native/pf_draft.c``: one C call per step), when this model qualifies: packed,
        float32 weights on the CPU, and the native library built. Returns whether it is on.
        A pass of more than NATIVE_MAX_ROWS rows, or one after a weight was replaced or moved,
        runs as PyTorch operators (the same maths; both keep the one cache). Matrices that hold
        bf16 values are read from bf16 copies made here: a weight changed in place afterwards
        (same tensor, same storage) is not seen until ``use_native`` runs again."""
        self._native, self._native_held = None, _Held()
        if not enable:
            return False
        attn0 = self.layers[0].self_attn
        if attn0._qkv is None or self.layers[0].mlp._gate_up is None:
            return False
        rope_type = getattr(self.rotary_emb, "rope_type", "default")
        if "dynamic" in rope_type or rope_type == "longrope":  # frequencies that follow the longest position:
            return False  # a table by position would not reproduce them
        if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in self.parameters()):
            return False
        from pdflash.native import NativeLibraryMissing
        from pdflash.native.draft_pass import DraftPass, DraftPassError, DraftShape

        cfg = self.config
        held = _Held()
        hold = held.add

        layers, windows = [], []
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            # the stacked layers hold views of the stacked weights the kernel reads
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                hold(lin, "weight")
                hold(lin, "bias")
            layers.append({
                "input_norm": hold(layer.input_layernorm, "weight"), "post_norm": hold(layer.post_attention_layernorm, "weight"),
                "w_qkv": a._qkv.weight, "b_qkv": a._qkv.bias, "q_norm": hold(a.q_norm, "weight"),
                "k_norm": hold(a.k_norm, "weight"), "w_o": a.o_proj.weight, "b_o": a.o_proj.bias,
                "w_gate_up": mlp._gate_up.weight, "w_down": mlp.down_proj.weight,
            })
            windows.append(a.sliding_window or 0)
        fc = hold(self.fc, "weight")
        # Matrices that are bf16 values (a bf16 checkpoint widened to float32) go to the kernel as
        # bf16 copies: half the bytes to read each step, the same products.
        names = ("w_qkv", "w_o", "w_gate_up", "w_down")
        if all(torch.equal(m.to(torch.bfloat16).float(), m) for m in [fc] + [layer[k] for layer in layers for k in names]):
            fc = fc.to(torch.bfloat16)
            for layer in layers:
                layer.update({k: layer[k].to(torch.bfloat16) for k in names})
        shape = DraftShape(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                           cfg.intermediate_size, self.fc.in_features, float(cfg.rms_norm_eps))
        try:
            self._native = DraftPass(shape, fc, hold(self.hidden_norm, "weight"), hold(self.norm, "weight"),
                                     layers, windows, level=level)
        except (NativeLibraryMissing, DraftPassError):  # no library, or a shape it does not take
            return False
        self._native_held = held
        return True

    def use_graphs(self, max_len: int = 0, *, enable: bool = True, graphs: bool | None = None, before_capture=None,
                   at: int | None = None, blocks=(), min_bucket: int | None = None) -> bool:
        """From now on run passes over a static cache of ``max_len`` positions (plus a block),
        replayed as CUDA graphs on a CUDA device (``graphs``, default: there), see
        ``pdflash/draft/graphed.py``; graphs for blocks of each B in ``blocks`` at ``at`` positions
        are captured now. ``before_capture`` runs before each capture (the offload runtime drains
        its copy threads); ``min_bucket``: the smallest key length attended (tests). Returns
        whether it is on: not for rotary frequencies that follow the longest position (a table by
        position would not reproduce them). A weight replaced or moved afterwards turns it off for
        good; ``enable`` False turns it off (the next sequence starts an ordinary cache)."""
        from pdflash.draft.graphed import DraftGraphs

        rope_type = getattr(self.rotary_emb, "rope_type", "default")
        if not enable or "dynamic" in rope_type or rope_type == "longrope":
            self._graphs = None
            return False
        g = self._graphs
        want_graphs = (self.fc.weight.device.type == "cuda") if graphs is None else bool(graphs)
        if g is None or not g.fits(max_len, want_graphs, min_bucket):  # one object serves every run that fits it
            self._graphs = g = None  # (the old graphs and cache go before the new ones are made)
            g = DraftGraphs(self, max_len, graphs=want_graphs, before_capture=before_capture, min_bucket=min_bucket)
        g.before_capture = before_capture
        self._graphs = g
        g.reset()
        if at is not None:
            self._graphs.prepare(at, blocks)
        return True

    @property
    def graphed(self) -> bool:
        """Whether passes run over the static cache of ``use_graphs`` (replayed as CUDA graphs
        where the draft is on CUDA)."""
        return self._graphs is not None

    def _graphs_intact(self) -> bool:
        """Whether the static-cache passes are on and still read this model's cache and weights;
        if a weight changed they turn off for good (the cache stays, as an ordinary one)."""
        g = self._graphs
        if g is None or self.cache is not g.cache:  # (warm_up swaps in a cache of its own for a while)
            return False
        if not g.intact():
            self._graphs = None
            return False
        return True

    @property
    def native(self) -> bool:
        """Whether passes run through the native CPU draft pass (``use_native``)."""
        return self._native is not None

    def _native_intact(self) -> bool:
        """Whether the native pass is on and every weight it reads is still the module's (the
        same tensor on the same storage); if not, it turns off for good."""
        if self._native is None:
            return False
        if not self._native_held.intact():
            self._native, self._native_held = None, _Held()  # a weight changed: PyTorch operators from now on
            return False
        return True

    def propose(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy proposals: argmax of the output head over hidden rows [r, H] -> token ids [r]
        (the native head when passes are native and the head is a bias-free linear on the CPU)."""
        w = getattr(self.lm_head, "weight", None)
        if (self._native is not None and isinstance(self.lm_head, nn.Linear) and self.lm_head.bias is None
                and w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16) and w.is_contiguous()
                and hidden.dtype == torch.float32 and hidden.shape[0]):
            return self._native.argmax(_rows(hidden).contiguous(), w)
        return self.head(hidden).argmax(-1)

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
        if self._graphs is not None:
            self._graphs.reset()  # the static cache again, empty

    def _context_rows(self, features: torch.Tensor | None) -> torch.Tensor:
        """Target features [1, n, K*H] -> projected context rows [n, H] (n = 0 for None)."""
        w = self.fc.weight
        if self._check_features(features) == 0:
            return w.new_empty((0, self.config.hidden_size))
        return self.hidden_norm(self.fc(_rows(features).to(device=w.device, dtype=w.dtype)))

    def _pass(self, ctx: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """One pass over the layers: context rows ctx [n, H] enter the cache (committed) and the
        block x [B, H] (B may be 0) attends to everything before it and to itself."""
        if self.cache is None:
            cfg = self.config
            self.cache = DraftKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, ctx.device, ctx.dtype)
        n, b, first = ctx.shape[0], x.shape[0], self.cache.length
        self.cache.reserve(n + b)
        pos = torch.arange(first, first + n + b, device=ctx.device)
        cos, sin = self.rotary_emb(ctx, pos[None])  # [1, n + b, D]
        half = cos.shape[-1] // 2
        cos, signed_sin = cos[0, :, None], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)[:, None]
        mask = None
        if b and self.config.sliding_window is not None and "sliding_attention" in self.config.layer_types:
            key_pos = torch.arange(0, first + n + b, device=ctx.device)
            mask = (pos[n:, None] - key_pos[None, :]) < self.config.sliding_window  # [B, C+n+B]
        for i, layer in enumerate(self.layers):
            if b == 0:
                layer.self_attn(ctx, n, cos, signed_sin, self.cache, i, None)
            else:
                x = layer(ctx, x, cos, signed_sin, self.cache, i, mask)
        self.cache.advance(n)
        return self.norm(x) if b else None

    def _check_features(self, features: torch.Tensor | None) -> int:
        """The row count n of target features [1, n, K*H] (0 for None); ValueError otherwise."""
        if features is None:
            return 0
        if features.dim() != 3 or features.shape[0] != 1 or features.shape[2] != self.fc.in_features:
            raise ValueError(f"expected target features [1, n, {self.fc.in_features}], got {tuple(features.shape)}")
        return features.shape[1]

    def _rope_tables(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [P >= end, D] by position, from the draft's own rotary module (grown by doubling)."""
        if self._rope is None or self._rope[0].shape[0] < end:
            size = max(end, 256, 2 * (self._rope[0].shape[0] if self._rope is not None else 0))
            w = self.fc.weight
            cos, sin = self.rotary_emb(w.new_empty((1, 1)), torch.arange(size, device=w.device)[None])
            self._rope = (cos[0].to(w.dtype).contiguous(), sin[0].to(w.dtype).contiguous())
        return self._rope

    def _native_pass(self, features: torch.Tensor | None, n: int, x: torch.Tensor | None) -> None:
        """The pass of ``_pass`` through the native kernel: features [1, n, K*H] (n may be 0), x [B, H]
        float32 (None for none; overwritten with the block's final hidden rows)."""
        cfg = self.config
        if self.cache is None:
            self.cache = DraftKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, "cpu", torch.float32)
        b = 0 if x is None else x.shape[0]
        self.cache.reserve(n + b)
        cos, sin = self._rope_tables(self.cache.length + n + b)
        rows = _rows(features).to(torch.float32).contiguous() if n else None
        self._native.run(self.cache.keys, self.cache.values, self.cache.length, rows, x, cos, sin)
        self.cache.advance(n)

    @torch.no_grad()
    def append_context(self, features: torch.Tensor) -> None:
        """Project the target features [1, n, K*H] of the next n committed tokens into every layer's K/V."""
        n = self._check_features(features)
        if n and self._graphs_intact():
            self._graphs.append(features)
            return
        if n and n <= NATIVE_MAX_ROWS and self._native_intact():
            self._native_pass(features, n, None)
            return
        ctx = self._context_rows(features)
        if ctx.shape[0]:
            self._pass(ctx, ctx[:0])

    @torch.no_grad()
    def forward(self, block_ids: torch.Tensor, start: int, context: torch.Tensor | None = None) -> torch.Tensor:
        """block_ids [1, B] at positions start .. start+B-1 -> final hidden states [1, B, H].

        ``context``: target features [1, n, K*H] of the n tokens committed since the last call,
        appended in the same pass (one projection per layer for their keys / values and the
        block's); ``start`` must equal ``context_length`` + n: the block begins right after the
        committed context.
        """
        n = self._check_features(context)
        if start != self.context_length + n:
            raise ValueError(f"block starts at {start} but the draft holds {self.context_length + n} context positions")
        if self._graphs_intact():
            if n:
                self._graphs.append(context)
            return self._graphs.block(block_ids)
        if n + block_ids.shape[1] <= NATIVE_MAX_ROWS and self._native_intact():
            emb = self.embed_tokens(block_ids[0].to(self.embed_tokens.weight.device))
            x = emb.to(device="cpu", dtype=torch.float32, copy=True).contiguous()
            self._native_pass(context, n, x)
            return x[None]
        ctx = self._context_rows(context)
        w = self.fc.weight
        x = self.embed_tokens(block_ids[0].to(self.embed_tokens.weight.device)).to(device=w.device, dtype=w.dtype)
        return self._pass(ctx.to(x.dtype), x)[None]

    @torch.no_grad()
    def warm_up(self, lengths) -> None:
        """For each length n: draft a block of n after n tokens of zero features (one pass, as a
        step does) and run the proposals' head; then forget that context. The first call of
        each shape pays the CPU library's setup for it, here instead of in a decode step."""
        saved = self.cache
        w = self.fc.weight
        for n in sorted(set(int(b) for b in lengths if int(b) >= 2)):
            self.cache = None
            self.head(self(self.block_ids(0, n, w.device), n, context=w.new_zeros((1, n, self.fc.in_features)))[:, 1:])
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
    return model.pack()
