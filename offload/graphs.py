"""Graphed decoding: the non-expert part of each decoder layer replayed as one CUDA graph.

On a GPU a batch-1 decode step is bound by the host: transformers' eager attention, norms and
router launch about fifty kernels per layer, each costing more host time than device time
(docs/benchmarks.md, profile). The experts cannot be captured: their routing must reach the host
to decide what to fetch. So a step is cut at the routing points into L + 1 segments:

    S_0    = embed, rotary, masks, layer 0 up to its router
    S_l    = residual add of layer l-1's expert output, layer l up to its router   (0 < l < L)
    S_L    = residual add of layer L-1's expert output, final norm, lm_head

and between S_l and S_l+1 the runtime's own experts module runs eagerly on S_l's static router
outputs (sync, fetch, compute). On CUDA each segment is captured once as a CUDA graph and replayed
every step; elsewhere (and for prefill, T > 1) the same segment functions run eagerly, which is
how the CPU tests check this file against the ordinary forward.

The modules are transformers' own (for gpt-oss: GptOssRMSNorm, GptOssAttention with its eager
attention and sinks, GptOssTopKRouter; for Qwen3-MoE: qk-normed eager attention and
Qwen3MoeTopKRouter); the family adapter's ``pre_experts`` is a layer up to its experts and its
``layer_types`` / ``sliding_window`` the attention kinds, and this file orders the calls as the
library's Model.forward and DecoderLayer.forward do, with a static KV cache: every layer keeps all positions up to
``max_len`` and an additive mask hides future positions (and, on sliding layers, those outside
the window). A graphed step attends to the first B positions, B the smallest of min_bucket,
2 min_bucket, 4 min_bucket, ... (capped at ``max_len``) that holds the step's position: shapes are
fixed within a bucket, one set of graphs is captured per bucket reached, and a short sequence in a
decoder sized for a long one does not pay for the whole cache every step. Eager forwards
(prefill) attend only to the positions written so far.

Host steps: a step whose every routed expert is computed on the CPU (``--cpu-experts all``, or the
hybrid guard's "all" arm), with no layer hooks, is captured whole instead, the experts of each
layer a host node between the segments' kernels (host_graph.py): one graph per (bucket, rows), no
Python between layers, the same arithmetic as the segments with the experts module between them.

Module hooks do not run inside replayed graphs, so the runtime's layer hooks (prefetcher, cache
bookkeeping) are called explicitly, in the same order, followed by ``layer_hooks`` (route-ahead's
pacing and lookahead in speculative decoding).

Blocks: ``forward(ids)`` runs T tokens at the current length (a speculative verify pass, or a
draft-free plain step at T = 1); graphs are captured per (key-length bucket, T), so each block
length a run uses replays its own graphs. It returns every position's logits and, for the layers
named in ``tap_layers``, their outputs (the draft's context features). ``truncate(n)`` drops the
positions from n on (rejected proposals): the static cache keeps their values, but every later
forward masks positions it has not written and overwrites them.

Fixed rows (``rows=R``, batch-invariant verify): a matrix product's kernel, and with it how a
row's sums are rounded, is chosen by the product's shape, so in bf16 a position's logits depend
on how many tokens its forward held (a verify block of 4 and a single-token step round apart, and
on random weights near-tied argmaxes flip). With ``rows`` every step (``decode`` and ``forward``
of 1 .. R tokens) runs R rows: the tokens, then copies of the last one at the next positions,
which no real row can see (causal mask) and which the next forward overwrites; the experts run on
the real rows only (their kernels compute each (token, expert) pair alone; the native CPU kernel
keeps its AMX tiles, which experts of several tokens would take, off for these steps:
``OffloadedModel.set_batch_invariant``), and every step
attends to the whole cache (one key length), so a position's arithmetic is the same whatever
block it is in and wherever in the block. The prefill is not padded (it is one computation per
prompt). The cache holds ``max_len + R - 1`` positions for the padding rows.
"""

from __future__ import annotations

import gc
import inspect
import os
import time
from contextlib import contextmanager

import torch
from torch import nn

from pdflash import PdflashError
from pdflash.offload.host_graph import HostSteps, host_steps_enabled
from pdflash.offload.prompt import chunked_prefill


@contextmanager
def no_collection():
    """No cyclic garbage collection until the block ends (graph captures). A collection inside a
    capture can free an earlier runtime's decoder (it holds its runtime, which holds it: a cycle)
    and with it CUDA graphs, whose destruction is not permitted while a stream captures: the
    capture fails ("operation failed due to a previous error during capture"; seen on an H100 in
    the fourth generate of one process, session 40). PyTorch's graph context no longer collects on
    entry unless configured to; the garbage is collected after the block instead."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class StaticKV:
    """Key / value buffers of every layer, [1, kv_heads, max_len, head_dim], zero-initialised
    (masked positions must hold finite values). ``update`` is what the library's attention calls: it writes
    the new keys / values at ``self.positions`` and returns the first ``self.visible`` positions
    (a graphed step: its bucket; an eager forward: the positions written so far, so a prefill
    costs what it costs without a static cache)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, max_len: int, dtype, device):
        shape = (1, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.positions = torch.zeros(1, dtype=torch.long, device=device)  # set before each forward
        self.visible = max_len  # set before each forward

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.k[layer_idx].index_copy_(2, self.positions, key)
        self.v[layer_idx].index_copy_(2, self.positions, value)
        n = self.visible
        return self.k[layer_idx][:, :, :n], self.v[layer_idx][:, :, :n]


def _cache_kw(attn: nn.Module) -> str:
    params = inspect.signature(attn.forward).parameters
    for name in ("cache", "past_key_values", "past_key_value"):
        if name in params:
            return name
    raise PdflashError(f"this transformers version's {type(attn).__name__} takes no KV cache argument pdflash knows")


class GraphedDecoder:
    """Prefill and batch-1 decode of an OffloadedModel through segment functions (see above).

    ``graphs`` (default: on CUDA) captures the decode segments as CUDA graphs on first use, once
    per key-length bucket (``min_bucket`` doubling up to ``max_len``). One instance holds one KV
    cache: ``prefill`` starts a sequence, ``decode`` continues it.
    """

    MIN_BUCKET = 256
    @classmethod
    def shared(cls, rt, max_len: int, rows: int | None = None, graphs: bool = True) -> "GraphedDecoder":
        """One decoder per (runtime, max_len, rows, graphs), kept on the runtime: its captured
        graphs (which read only its own static tensors; experts run outside them) serve every run
        of that length instead of being captured again."""
        per_rt = rt.__dict__.setdefault("_graphed_decoders", {})
        key = (int(max_len), rows, bool(graphs))
        dec = per_rt.get(key)
        if dec is None:
            dec = per_rt[key] = cls(rt, max_len=max_len, graphs=graphs, rows=rows)
        return dec

    def __init__(self, rt, max_len: int, graphs: bool | None = None, min_bucket: int | None = None,
                 rows: int | None = None):
        model = rt.model
        cfg = model.config
        self.rt = rt
        self.model = model
        self.family = rt.family
        self.layers = self.family.decoder_layers(model)
        self.layer_types = self.family.layer_types(cfg)
        self.window = self.family.sliding_window(cfg)
        self.device = rt.device
        self.dtype = rt.dtype
        self.max_len = int(max_len)
        self.min_bucket = max(1, int(min_bucket or self.MIN_BUCKET))
        if rows is not None and int(rows) < 1:
            raise PdflashError(f"fixed rows must be at least 1, got {rows}")
        self.rows = None if rows is None else int(rows)  # every step's row count (fixed rows), or None
        # whether decode steps and blocks ask the CPU experts for batch-invariant calls
        # (OffloadedModel.set_batch_invariant): with fixed rows always; an unpadded decoder whose
        # blocks round as its single steps do (draft/offloaded.py, rows_agree) asks in oracle mode
        self.invariant = self.rows is not None
        self.rows_check: str | None = None  # draft/offloaded.py verify_decoder: "agree", "differ" or None
        self.capacity = self.max_len + (self.rows - 1 if self.rows else 0)  # positions the cache holds
        hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        try:
            self.kv = StaticKV(len(self.layers), int(cfg.num_key_value_heads), hd, self.capacity, self.dtype, self.device)
        except torch.OutOfMemoryError:
            gib = 2 * len(self.layers) * int(cfg.num_key_value_heads) * hd * self.capacity * self.dtype.itemsize / 2**30
            raise PdflashError(f"a static KV cache of {self.max_len} positions ({gib:.1f} GiB) does not fit on the device: "
                               "lower --max-new-tokens, or decode with --no-cuda-graphs (a cache that grows)") from None
        self.cache_kw = _cache_kw(self.layers[0].self_attn)
        self.graphs = (self.device.type == "cuda") if graphs is None else bool(graphs)
        if self.graphs and self.device.type != "cuda":
            raise PdflashError("CUDA graphs need --device cuda")
        dev = self.device
        with torch.inference_mode():
            all_pos = torch.arange(self.capacity, device=dev)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=dev)
            cos, sin = model.model.rotary_emb(probe, all_pos)  # [1, max_len, hd]
        self.cos, self.sin = cos, sin
        self.key_pos = torch.arange(self.capacity, device=dev)  # [capacity]
        self.length = 0  # positions written so far
        self._steps: dict[tuple[int, int], list] = {}  # (key-length bucket, T) -> captured graphs and static tensors
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # T -> static (ids [1, T], positions [T])
        self.ids, self.pos = self._static_inputs(1)  # decode-step static inputs
        self.tap_layers: list[int] = []  # layers whose outputs forward() returns as features
        self.layer_hooks: list = []  # fn(layer, hidden after attention), called before each layer's experts
        self._host_graphs: dict[tuple[int, int, str], list] = {}  # (bucket, rows, mode) -> a host step's graph and tensors
        self.host_steps_enabled = host_steps_enabled()
        # PDFLASH_SPLIT_STEPS=0: the model arm runs as segmented graphs, its misses split per layer from Python
        self.split_steps_enabled = os.environ.get("PDFLASH_SPLIT_STEPS", "1") != "0"

    def _static_inputs(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        if T not in self._inputs:
            self._inputs[T] = (torch.zeros((1, T), dtype=torch.long, device=self.device),
                               torch.zeros(T, dtype=torch.long, device=self.device))
        return self._inputs[T]

    # -- segments ---------------------------------------------------------------------
    def _masks(self, pos: torch.Tensor, n_keys: int) -> dict[str, torch.Tensor]:
        """Additive masks [1, 1, T, n_keys] for query positions ``pos`` [T]."""
        q = pos[:, None]
        k = self.key_pos[None, :n_keys]
        full = k <= q
        neg = torch.finfo(self.dtype).min
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        low = torch.full((), neg, dtype=self.dtype, device=self.device)
        out = {"full_attention": torch.where(full, zero, low)[None, None]}
        if self.window:
            sliding = full & (k > q - self.window)
            out["sliding_attention"] = torch.where(sliding, zero, low)[None, None]
        return out

    def _embed(self, ids: torch.Tensor, pos: torch.Tensor, n_keys: int):
        x = self.model.model.embed_tokens(ids)  # [1, T, H]
        pe = (self.cos.index_select(1, pos), self.sin.index_select(1, pos))
        return x, pe, self._masks(pos, n_keys)

    def _pre_experts(self, i: int, x: torch.Tensor, pe, masks):
        """Layer i up to its experts (the family's segment): returns (residual after attention,
        normed MLP input [T, H], routing weights, router indices)."""
        return self.family.pre_experts(self.layers[i], x, pe, masks[self.layer_types[i]], self.kv, self.cache_kw)

    def _experts(self, i: int, x, flat, scores, indices) -> torch.Tensor:
        """Layer i's experts, eagerly. The runtime's layer-start hook runs first, explicitly; its
        lookahead sees the residual stream after layer i's attention (the ordinary forward gives
        it the stream entering the layer)."""
        self.rt.prefetcher.on_layer_start(i, x)
        for hook in self.layer_hooks:
            hook(i, x)
        return self.layers[i].mlp.experts(flat, indices, scores)

    def _head(self, x: torch.Tensor, last: bool = True) -> torch.Tensor:
        """Logits, float32: of the last position [1, V], or of every position [T, V]."""
        if last:
            return self.model.lm_head(self.model.model.norm(x[:, -1:]))[:, -1].float()
        return self.model.lm_head(self.model.model.norm(x))[0].float()

    def _features(self, outputs: dict[int, torch.Tensor]) -> torch.Tensor | None:
        if not self.tap_layers:
            return None
        return torch.cat([outputs[i] for i in self.tap_layers], dim=-1)  # [1, T, K*H]

    # -- fixed rows ------------------------------------------------------------------------
    def _step_rows(self, T: int) -> int:
        """Rows a step of T tokens runs: T, or the fixed row count."""
        if self.rows is None:
            return T
        if T > self.rows:
            raise PdflashError(f"a block of {T} tokens is longer than this decoder's {self.rows} fixed rows")
        return self.rows

    def _padded(self, tokens: list[int]) -> list[int]:
        return tokens + [tokens[-1]] * (self._step_rows(len(tokens)) - len(tokens))

    def _check_room(self, T: int) -> None:
        if self.length + T > self.max_len:
            raise PdflashError(f"the sequence would reach {self.length + T} positions; this decoder holds {self.max_len}")

    # -- eager (prefill, CPU) ------------------------------------------------------------
    def _forward_eager(self, tokens: list[int], last: bool = True, pad: bool = False):
        """T tokens at the current length -> (logits, tapped layer outputs or None); ``pad``
        runs them as a fixed-rows step (the tokens first, see the module's docstring)."""
        T = len(tokens)
        ids = self._padded(tokens) if pad else tokens
        self._check_room(T)
        n = len(ids)
        pos = torch.arange(self.length, self.length + n, device=self.device)
        self.kv.positions = pos
        self.kv.visible = self.capacity if pad else self.length + T  # eager: only the positions written so far
        self.rt.begin_forward(T)
        x, pe, masks = self._embed(torch.tensor([ids], device=self.device), pos, self.kv.visible)
        taps = {}
        for i in range(len(self.layers)):
            x, flat, scores, indices = self._pre_experts(i, x, pe, masks)
            e = self._experts(i, x[:, :T], flat[:T], scores[:T], indices[:T]).reshape(1, T, -1)
            if n > T:
                e = torch.cat([e, e.new_zeros(1, n - T, e.shape[-1])], dim=1)
            x = x + e
            if i in self.tap_layers:
                taps[i] = x[:, :T]
        self.length += T
        if pad:  # the head over every row too: one shape for every step
            logits = self._head(x, last=False)[:T]
            return (logits[-1:] if last else logits), self._features(taps)
        return self._head(x, last), self._features(taps)

    # -- graphed decode -------------------------------------------------------------------
    def bucket(self, n: int) -> int:
        """Key length a graphed step at ``n`` positions (its own included) attends to: with fixed
        rows, the whole cache."""
        if self.rows is not None:
            return self.capacity
        b = self.min_bucket
        while b < n:
            b *= 2
        return min(b, self.max_len)

    @contextmanager
    def _capturing(self):
        """Graph capture on a side stream into one memory pool: yields ``capture(fn) -> (graph,
        fn's result)``, which runs fn once eagerly first (allocations, lazy inits). The
        scheduler's copy threads use CUDA too: nothing of theirs is in flight during the capture,
        and only this thread's calls capture errors ("thread_local"). No cyclic garbage collection
        runs inside (:func:`no_collection`)."""
        self.rt.cache.drain()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))

        def capture(fn):
            fn()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode="thread_local"):
                res = fn()
            return g, res

        with no_collection(), torch.inference_mode(), torch.cuda.stream(stream):
            yield capture
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _capture(self, bucket: int, T: int) -> list:
        """Capture the segments of a T-token step for one key-length bucket (static inputs
        ``_static_inputs(T)``)."""
        n = len(self.layers)
        H = self.model.config.hidden_size
        ids, pos = self._static_inputs(T)
        e_in = [torch.zeros((T, H), dtype=self.dtype, device=self.device) for _ in range(n)]  # experts outputs
        segs = []

        def seg0():
            self.kv.positions = pos
            self.kv.visible = bucket
            x, pe, masks = self._embed(ids, pos, bucket)
            return (pe, masks) + self._pre_experts(0, x, pe, masks)

        def make_mid(i, prev):
            def seg():
                pe, masks, x_prev = prev["pe"], prev["masks"], prev["x"]
                x = x_prev + e_in[i - 1].view_as(x_prev)
                return self._pre_experts(i, x, pe, masks)
            return seg

        outs: list[dict] = []
        with self._capturing() as capture:
            for i in range(n + 1):
                if i == 0:
                    fn = seg0
                elif i < n:
                    fn = make_mid(i, outs[-1])
                else:
                    last = outs[-1]
                    head_last = T == 1 and self.rows is None
                    fn = (lambda last=last: self._head(last["x"] + e_in[n - 1].view_as(last["x"]), last=head_last))
                g, res = capture(fn)
                if i == 0:
                    pe, masks, x, flat, scores, indices = res
                    outs.append({"pe": pe, "masks": masks, "x": x, "flat": flat, "scores": scores, "indices": indices})
                elif i < n:
                    x, flat, scores, indices = res
                    outs.append({"pe": outs[0]["pe"], "masks": outs[0]["masks"], "x": x, "flat": flat,
                                 "scores": scores, "indices": indices})
                else:
                    outs.append({"logits": res})
                segs.append(g)
        return [segs, outs, e_in]

    def _step_graphed(self, tokens: list[int]):
        """Replay the T-token step's graphs at the current length -> (logits, features)."""
        T = len(tokens)
        ids_in = self._padded(tokens)
        self._check_room(T)
        R = len(ids_in)  # rows of the captured step: T, or the fixed rows
        # Static inputs first: a capture's warm-up runs the segments eagerly and writes these
        # positions' keys / values, which the replay below then overwrites.
        ids, pos = self._static_inputs(R)
        if R == 1:
            ids.fill_(int(tokens[0]))
            pos.fill_(self.length)
        else:
            ids.copy_(torch.tensor([ids_in], dtype=torch.long))
            pos.copy_(torch.arange(self.length, self.length + R))
        bucket = self.bucket(self.length + T)
        if not self._host_mode(T) and (bucket, R) not in self._steps:
            self._steps[(bucket, R)] = self._capture(bucket, R)
        self.kv.positions = pos
        self.kv.visible = bucket
        self.rt.begin_forward(T)
        mode = self._host_mode(T)  # the placement is final once the forward has begun (the guard)
        if mode:
            return self._step_host(bucket, R, T, mode)
        if (bucket, R) not in self._steps:  # the guard left the "all" arm at this forward
            self._steps[(bucket, R)] = self._capture(bucket, R)
        segs, outs, e_in = self._steps[(bucket, R)]
        n = len(self.layers)
        taps = {}
        for i in range(n):
            segs[i].replay()
            o = outs[i]
            x = o["x"] if R == T else o["x"][:, :T]
            e = self._experts(i, x, o["flat"][:T], o["scores"][:T], o["indices"][:T])
            e_in[i][:T].copy_(e.view(T, -1))
            if R > T:
                e_in[i][T:].zero_()  # padding rows: no experts
            if i in self.tap_layers:
                taps[i] = x + e_in[i][:T].view_as(x)
        segs[n].replay()
        self.length += T
        logits = outs[n]["logits"]
        return (logits if R == T else logits[:T]).clone(), self._features(taps)

    # -- host steps (host_graph.py) -----------------------------------------------------------
    def _host_mode(self, T: int, placement: str | None = "current") -> str | None:
        """The host step this forward runs as ("all", "host" or "split", see host_graph.py), or
        None: it needs CUDA graphs, a native CPU runner, a placement a host step serves ("all":
        every routed expert on the CPU; "host": the cache's hits on the device and every other
        expert on the CPU; "split": "host" with part of the misses fetched into stages) and no
        layer hooks (they need Python between layers); ``PDFLASH_HOST_STEPS=0`` turns host steps
        off, ``PDFLASH_SPLIT_STEPS=0`` the "split" ones."""
        if not self.graphs or self.layer_hooks or not self.host_steps_enabled:
            return None
        mode = self.rt.host_placement(T) if placement == "current" else placement
        if mode is None or (mode == "split" and not self.split_steps_enabled):
            return None
        steps = HostSteps.for_runtime(self.rt)
        return mode if steps is not None and steps.can_run(mode, self._step_rows(T)) else None

    def _host_step_fn(self, bucket: int, R: int, layers: list):
        """The step of R rows with host experts: () -> (logits, every layer's output) from the
        static inputs. Captured as one graph on CUDA; the CPU tests run it eagerly."""
        ids, pos = self._static_inputs(R)
        head_last = R == 1 and self.rows is None

        def step():
            self.kv.positions = pos
            self.kv.visible = bucket
            x, pe, masks = self._embed(ids, pos, bucket)
            xs = []
            for i, lay in enumerate(layers):
                x, flat, scores, indices = self._pre_experts(i, x, pe, masks)
                # route-ahead ("split"): the next layer's router on this residual stream, for its host node
                ahead = self.family.router_topk(self.model, i + 1, x.reshape(-1, x.shape[-1])) if lay.ahead else None
                x = lay(flat, scores, indices, ahead, residual=x)  # the layer's output: x plus its experts'
                xs.append(x)
            return self._head(x, last=head_last), xs

        return step

    def _capture_host(self, bucket: int, R: int, mode: str = "all") -> list:
        steps = HostSteps.for_runtime(self.rt)
        layers = steps.layers(R, self.dtype, mode)
        steps.before_step(mode, R, R)  # the warm-up reads the slot table and the plan
        with self._capturing() as capture:  # the warm-up's host calls run, and are counted
            g, (logits, xs) = capture(self._host_step_fn(bucket, R, layers))
        return [g, logits, xs, layers, steps]

    def _step_host(self, bucket: int, R: int, T: int, mode: str = "all"):
        if (bucket, R, mode) not in self._host_graphs:
            self._host_graphs[(bucket, R, mode)] = self._capture_host(bucket, R, mode)
        g, logits, xs, layers, steps = self._host_graphs[(bucket, R, mode)]
        steps.before_step(mode, R, T)
        for lay in layers:
            lay.set_tokens(T)
        # a step that fetches nothing ("all", "host") has every pool thread; the others leave the
        # copy workers their cores (CpuExpertRunner.use_threads)
        steps.runner.use_threads(mode != "split")
        steps.runner.prewake()  # layer 0's call comes after the embedding and its attention
        launched = time.monotonic_ns()
        try:
            steps.replay(g, layers)
            done = time.monotonic_ns()
        finally:
            steps.runner.use_threads(False)
        steps.finish(layers, T, launched, done)
        self.length += T
        taps = {i: (xs[i] if R == T else xs[i][:, :T]) for i in self.tap_layers}
        return (logits if R == T else logits[:T]).clone(), self._features(taps)

    # -- public ----------------------------------------------------------------------------
    def prepare(self, length: int | None = None, tokens=(1,)) -> None:
        """Capture now (else on first use) the graphs of the bucket that a step of each T in
        ``tokens`` at ``length`` positions (default: the current length) uses, for each placement
        such a step may take (``rt.host_placements``: every arm the hybrid guard still tries); a
        no-op without graphs."""
        if not self.graphs:
            return
        for T, placement in [(T, p) for T in tokens for p in self.rt.host_placements(T)]:
            at = min(self.length if length is None else int(length), self.max_len - T)
            bucket, R = self.bucket(at + T), self._step_rows(T)
            mode = self._host_mode(T, placement)
            key = (bucket, R, mode) if mode else (bucket, R)
            graphs = self._host_graphs if mode else self._steps
            if key not in graphs:
                ids, pos = self._static_inputs(R)
                start = max(at, self.length)  # the warm-up writes only positions not yet used
                pos.copy_(torch.arange(start, start + R))
                graphs[key] = self._capture_host(bucket, R, mode) if mode else self._capture(bucket, R)

    def prefill(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Start a sequence: run the prompt, return the last position's logits [1, V] (float32)."""
        return self.prefill_with_features(ids)[0]

    def prefill_with_features(self, ids: list[int] | torch.Tensor):
        """:meth:`prefill`, also returning the ``tap_layers`` outputs [1, T, K*H] (or None)."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
        self.length = 0
        self.rt.begin_sequence(self.max_len - int(ids.shape[1]))  # at most that many steps follow
        self.rt.set_batch_invariant(False)  # the prompt is one computation however it is verified
        feats = []  # every chunk's tapped outputs: the draft needs all the prompt's positions

        def run(chunk: torch.Tensor, start: int) -> torch.Tensor:
            logits, f = self._forward_eager(chunk[0].tolist())
            if f is not None:
                feats.append(f)
            return logits

        with torch.inference_mode():
            logits = chunked_prefill(run, ids)
        return logits, (torch.cat(feats, dim=1) if feats else None)

    def decode(self, token_id: int) -> torch.Tensor:
        """Feed one token; returns its next-token logits [1, V] (float32)."""
        if self.length >= self.max_len:
            raise PdflashError(f"the sequence reached {self.max_len} positions, the most this decoder holds")
        self.rt.set_batch_invariant(self.invariant)
        with torch.inference_mode():
            if self.graphs:
                return self._step_graphed([int(token_id)])[0]
            return self._forward_eager([int(token_id)], pad=self.rows is not None)[0]

    def forward(self, tokens: list[int]):
        """Feed T tokens at the current length (a verify block); returns (logits [T, V] float32,
        ``tap_layers`` outputs [1, T, K*H] or None). Graphed when the decoder is, eager otherwise."""
        tokens = [int(t) for t in tokens]
        self.rt.set_batch_invariant(self.invariant)  # the CPU experts too (fixed rows, or oracle mode)
        with torch.inference_mode():
            if self.graphs:
                return self._step_graphed(tokens)
            return self._forward_eager(tokens, last=False, pad=self.rows is not None)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (drop rejected proposals)."""
        if not 0 <= length <= self.length:
            raise PdflashError(f"cannot truncate {self.length} positions to {length}")
        self.length = int(length)
