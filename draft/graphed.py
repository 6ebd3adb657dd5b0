"""The draft's passes over a static cache, replayed as CUDA graphs.

On a GPU an eager draft pass is bound by the host: every layer launches a few dozen small
kernels (norms, projections, rotary, attention, MLP), and the arithmetic of a block of a few rows
costs far less than the launches. On the H200 an eager step of a 2-token block of the
gpt-oss-20b-shaped draft took 12.6-13.9 ms, two thirds of a graphed verify forward of the target
(docs/benchmarks.md, session 14). So, as for the target (``pdflash.offload.graphs``), each pass
is captured once per shape and replayed.

A draft step (``DFlashDraftModel.forward``) is cut in two:

    append(n)  the features of n newly committed tokens -> ``fc`` -> ``hidden_norm`` -> each
               layer's keys / values, written at positions L .. L+n-1 (context rows provide keys
               and values only; nothing attends from them). Rows are independent, so any n runs
               as chunks of at most ``chunk`` rows, one graph per chunk length.
    block(B)   [last token, MASK x (B-1)] at positions L .. L+B-1 through every layer, its own
               keys / values written after the context (scratch: the cache's length does not move,
               the next append overwrites them), attending to the first ``bucket`` positions of the
               cache through a mask that hides positions from L+B on (and, on sliding layers,
               those outside the window), then the final norm. One graph per (bucket, B).

The arithmetic is the eager pass's (``DFlashDraftModel._pass``), with the context's and the
block's projections as separate products, so rows may round differently; proposals are verified
either way, so the output of speculative decoding does not depend on it. The cache is static:
``capacity`` positions, zeroed (masked keys must hold finite values), never reallocated while
graphs read it. Keys are attended in buckets (``min_bucket`` doubling up to ``capacity``), so a
short sequence in a cache sized for a long one does not pay for the whole cache every step; with
graphs, a cache of at most ``ONE_BUCKET`` positions is one bucket (fewer captures mid-run).

Without CUDA (``graphs=False``) the same functions run eagerly: the CPU tests check them against
the eager pass and an independent reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdflash import PdflashError
from pdflash.offload.graphs import no_collection

# A context append of more rows than this (the prompt's, on the first step) runs as the eager
# pass does, once, instead of as many chunk replays.
EAGER_CONTEXT_ROWS = 64


class DraftGraphs:
    """Static-cache passes of ``draft`` (a ``DFlashDraftModel`` whose rotary frequencies do not
    depend on the longest position: ``use_graphs`` checks), see the module docstring.

    ``max_len``: the positions a sequence may reach (prompt + new tokens); the cache holds
    ``max_len + chunk`` so a block drafted at the last position fits. ``before_capture``: called
    before each capture (the offload runtime drains its copy threads, as for the target's graphs).
    """

    MIN_BUCKET = 256
    # With graphs and no min_bucket given, a cache of at most this many positions is attended whole:
    # one block graph per B instead of one per (bucket, B). Captured as a sequence crossed a bucket,
    # they cost the embedded pair's default run on CUDA 10 captures, 0.50 s of a profiled 400-token
    # decode (docs/benchmarks.md, session 36); masked keys cost the tiny draft little.
    ONE_BUCKET = 1024

    def __init__(self, draft, max_len: int, *, graphs: bool | None = None, chunk: int | None = None,
                 min_bucket: int | None = None, before_capture=None):
        from pdflash.draft.model import DraftKVCache, _Held

        cfg = draft.config
        w = draft.fc.weight
        self.draft = draft
        self.device, self.dtype = w.device, w.dtype
        self.graphs = (self.device.type == "cuda") if graphs is None else bool(graphs)
        if self.graphs and self.device.type != "cuda":
            raise PdflashError("CUDA graphs need the draft on a CUDA device")
        self.chunk = max(1, int(chunk or cfg.block_size))
        self.capacity = int(max_len) + self.chunk
        self.min_bucket = max(1, int(min_bucket or self.MIN_BUCKET))
        self._whole = self.graphs and min_bucket is None and self.capacity <= self.ONE_BUCKET
        self.before_capture = before_capture
        try:
            self.cache = DraftKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, self.device,
                                      self.dtype, capacity=self.capacity, zeroed=True)
        except torch.OutOfMemoryError:
            raise PdflashError(f"the draft's static cache of {self.capacity} positions does not fit on the device: "
                               "lower --max-new-tokens, or run with --no-cuda-graphs") from None
        self._keys_ptr = self.cache.keys.data_ptr()
        self._held = _Held()  # every weight the captured passes read
        for module in draft.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    self._held.add(module, name)
        cos, sin = draft._rope_tables(self.capacity)  # [P, D] by position, the draft's dtype
        half = cos.shape[-1] // 2
        self.cos = cos
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).contiguous()
        self.key_pos = torch.arange(self.capacity, device=self.device)
        self.start = torch.zeros((), dtype=torch.long, device=self.device)  # first position of the next pass
        self.offsets = torch.arange(max(self.chunk, cfg.block_size), device=self.device)
        self.window = cfg.sliding_window
        self.sliding = [t == "sliding_attention" for t in cfg.layer_types]
        self._ctx_in: dict[int, torch.Tensor] = {}  # n -> static features [n, K*H]
        self._ids: dict[int, torch.Tensor] = {}  # B -> static block ids [B]
        self._outs: dict = {}  # key -> static output (block: hidden [B, H]; append: None)
        self._graphs: dict = {}  # key -> torch.cuda.CUDAGraph
        self._pool = None
        self.replays = 0  # passes that ran through this object (graphed or eagerly)
        self.failure: str | None = None  # why graphs were given up (a capture CUDA refused), or None

    # -- state --------------------------------------------------------------------------
    def _unchanged(self) -> bool:
        """The cache's buffers were not reallocated and no weight was replaced or moved since the
        graphs were built."""
        return self.cache.keys.data_ptr() == self._keys_ptr and self._held.intact()

    def intact(self) -> bool:
        """The draft still reads this object's cache, and nothing the graphs read has changed."""
        return self.draft.cache is self.cache and self._unchanged()

    def fits(self, max_len: int, graphs: bool, min_bucket: int | None = None) -> bool:
        """Whether this object serves a sequence of ``max_len`` positions with (or without) graphs
        (one whose capture CUDA refused serves with its eager passes instead of trying again)."""
        same = self.graphs == graphs or (graphs and self.failure is not None)
        return (same and self.capacity >= int(max_len) + self.chunk
                and self.min_bucket == max(1, int(min_bucket or self.MIN_BUCKET)) and self._unchanged())

    def reset(self) -> None:
        """A new sequence: no context."""
        self.cache.length = 0
        self.draft.cache = self.cache

    def bucket(self, n: int) -> int:
        """Key length a pass reaching ``n`` positions attends to (see ``ONE_BUCKET``)."""
        if self._whole:
            return self.capacity
        b = self.min_bucket
        while b < n:
            b *= 2
        return min(b, self.capacity)

    # -- static inputs ---------------------------------------------------------------------
    def _ctx_buffer(self, m: int) -> torch.Tensor:
        """The static features [m, K*H] of an append of m rows."""
        if m not in self._ctx_in:
            self._ctx_in[m] = torch.zeros((m, self.draft.fc.in_features), dtype=self.dtype, device=self.device)
        return self._ctx_in[m]

    def _ids_buffer(self, b: int) -> torch.Tensor:
        """The static block ids [B] of a block of b."""
        if b not in self._ids:
            self._ids[b] = torch.zeros(b, dtype=torch.long, device=self.device)
        return self._ids[b]

    # -- the two passes, as functions of static tensors ------------------------------------
    def _rope(self, n: int):
        pos = self.start + self.offsets[:n]
        return pos, self.cos.index_select(0, pos)[:, None], self.signed_sin.index_select(0, pos)[:, None]

    def _append_fn(self, n: int):
        from pdflash.draft.model import _rotate

        draft, cache = self.draft, self.cache
        feats = self._ctx_buffer(n)

        def fn():
            pos, cos, ssin = self._rope(n)
            rows = draft.hidden_norm(draft.fc(feats))  # [n, H]
            for i, layer in enumerate(draft.layers):
                a = layer.self_attn
                k = _rotate(a.k_norm(a.k_proj(rows).view(n, a.n_kv, a.head_dim)), cos, ssin)
                v = a.v_proj(rows).view(n, a.n_kv, a.head_dim)
                cache.keys[i].index_copy_(2, pos, k.transpose(0, 1)[None])
                cache.values[i].index_copy_(2, pos, v.transpose(0, 1)[None])
            return None
        return fn

    def _block_fn(self, bucket: int, b: int):
        from pdflash.draft.model import _rotate

        draft, cache = self.draft, self.cache
        ids = self._ids_buffer(b)

        def fn():
            pos, cos, ssin = self._rope(b)
            x = draft.embed_tokens(ids).to(self.dtype)  # [B, H]
            keys_pos = self.key_pos[:bucket]
            visible = keys_pos[None, :] <= pos[-1]  # [1, bucket]: the context and the whole block
            masks = {False: visible.expand(b, bucket)}
            if self.window is not None and any(self.sliding):
                masks[True] = visible & ((pos[:, None] - keys_pos[None, :]) < self.window)
            for i, layer in enumerate(draft.layers):
                a = layer.self_attn
                h = layer.input_layernorm(x)
                q, k, v = a._project(h)
                k = _rotate(a.k_norm(k.view(b, a.n_kv, a.head_dim)), cos, ssin)
                cache.keys[i].index_copy_(2, pos, k.transpose(0, 1)[None])
                cache.values[i].index_copy_(2, pos, v.view(b, a.n_kv, a.head_dim).transpose(0, 1)[None])
                q = _rotate(a.q_norm(q.view(b, a.n_heads, a.head_dim)), cos, ssin)
                keys, values = cache.keys[i][:, :, :bucket], cache.values[i][:, :, :bucket]
                mask = masks[self.sliding[i] and self.window is not None]
                out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask[None, None],
                                                     enable_gqa=a.n_heads != a.n_kv)  # [1, Hq, B, D]
                x = x + a.o_proj(out[0].transpose(0, 1).reshape(b, a.n_heads * a.head_dim))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            return draft.norm(x)
        return fn

    def _run(self, key, make):
        """Run the pass ``key``: replay its graph (captured now if new), or call it eagerly."""
        self.replays += 1
        if self.graphs and key not in self._graphs:
            self._try_capture(key, make())
        if not self.graphs:
            return make()()
        self._graphs[key].replay()
        return self._outs[key]

    def _try_capture(self, key, fn) -> None:
        """Capture ``fn`` as the graph of ``key``; if CUDA refuses, every pass from now on runs
        eagerly (the same functions: slower, the same results) and ``failure`` says why."""
        try:
            self._graphs[key], self._outs[key] = self._capture(fn)
        except RuntimeError as exc:
            self.graphs = False
            self._graphs.clear()
            self._outs.clear()
            self.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def _capture(self, fn):
        """Capture ``fn`` as a CUDA graph after one warm-up call; its writes land at positions
        from ``start`` on, which are scratch until the pass being run commits them."""
        if self.before_capture is not None:
            self.before_capture()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with no_collection(), torch.inference_mode(), torch.cuda.stream(stream):
            fn()  # warm-up outside the graph (allocations, lazy inits)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                out = fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return g, out

    # -- public ----------------------------------------------------------------------------
    def _check_room(self, n: int) -> None:
        if self.cache.length + n > self.capacity:
            raise PdflashError(f"the draft's static cache holds {self.capacity} positions; "
                               f"a pass would reach {self.cache.length + n}")

    def append(self, features: torch.Tensor) -> None:
        """Project the target features [1, n, K*H] of the next n committed tokens into every
        layer's keys / values and commit them (chunks of at most ``chunk`` rows)."""
        n = int(features.shape[1])
        self._check_room(n)
        if n > EAGER_CONTEXT_ROWS:
            ctx = self.draft._context_rows(features)
            self.draft._pass(ctx, ctx[:0])
            return
        rows = features[0].to(device=self.device, dtype=self.dtype)
        for lo in range(0, n, self.chunk):
            part = rows[lo: lo + self.chunk]
            m = part.shape[0]
            self._ctx_buffer(m).copy_(part)
            self.start.fill_(self.cache.length)
            self._run(("append", m), lambda m=m: self._append_fn(m))
            self.cache.advance(m)

    def block(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Draft the block ``block_ids`` [1, B] after the committed context -> final hidden
        states [1, B, H] (a copy; the static output is overwritten by the next pass)."""
        b = int(block_ids.shape[1])
        self._check_room(b)
        if b > self.offsets.shape[0]:
            raise PdflashError(f"a block of {b} is longer than the draft's trained block of {self.offsets.shape[0]}")
        self._ids_buffer(b).copy_(block_ids[0])
        self.start.fill_(self.cache.length)
        bucket = self.bucket(self.cache.length + b)
        out = self._run((bucket, b), lambda: self._block_fn(bucket, b))
        return out.clone()[None]

    def prepare(self, length: int, blocks) -> None:
        """Capture now (else on first use) the graphs a step at ``length`` positions uses: blocks
        of each B in ``blocks`` and appends of 1 .. ``chunk`` rows. Writes only scratch
        positions; a no-op without graphs."""
        if not self.graphs:
            return
        saved = self.cache.length
        self.cache.length = min(int(length), self.capacity - self.chunk)
        try:
            for m in range(1, self.chunk + 1):
                if self.graphs and ("append", m) not in self._graphs:
                    self.start.fill_(self.cache.length)
                    self._try_capture(("append", m), self._append_fn(m))
            for b in sorted(set(int(b) for b in blocks if int(b) >= 2)):
                bucket = self.bucket(self.cache.length + b)
                if self.graphs and (bucket, b) not in self._graphs:
                    self._ids_buffer(b).fill_(self.draft.config.mask_token_id)
                    self.start.fill_(self.cache.length)
                    self._try_capture((bucket, b), self._block_fn(bucket, b))
        finally:
            self.cache.length = saved
