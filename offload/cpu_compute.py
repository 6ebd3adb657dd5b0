"""Experts computed on the CPU by the native kernel (native/pf_cpu.c), straight from the host store.

    runner = CpuExpertRunner(host, alpha=1.702, limit=7.0, threads=8)   # gpt-oss
    runner = RowsExpertRunner(host, threads=8)                         # Qwen3-MoE
    y = runner.run(layer, expert, x_rows)   # x_rows [n, H] host float32 / bfloat16 -> [n, H] float32

Each (layer, expert)'s weights are views of its packed host row (gpt-oss: MXFP4 blocks + E8M0
scales, or bf16 / float32 dense weights; Qwen3-MoE: bf16 / float32 rows, or FP8 rows and their
block scales): nothing is dequantized or copied. The runner measures every
call (bytes of weights read and seconds) and keeps an exponentially weighted rate, the CPU
side of the placement cost model; ``calibrate()`` measures it once before the first use, and
with it what a call over 2, 4, 8 and 16 tokens costs relative to one token (the AVX-512 kernel
pays each token's dot products, about 1.25 ms per token past the first on one thread of the
H200 host; the AMX kernel costs about the same for 4 to 16 tokens), so that a verify block's or
a prefill's experts are priced at what their token counts cost on this machine.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch

from pdflash import PdflashError
from pdflash.offload.host_store import ExpertLayout, HostStore

CPU_EXPERT_MODES = ("auto", "off", "all")
_DENSE_DTYPES = (torch.bfloat16, torch.float32)
_EWMA = 0.2  # weight of the newest measurement in the kept rate
# split host steps' route-ahead (CpuPlacement.split_plan): the priors until measured. The next
# router on a layer's residual stream named 70-79 % of the experts the next layer routed to on the
# synthetic gpt-oss-20b shape (the prefetcher's lookahead accuracy, CPU, docs/benchmarks.md)
AHEAD_PRECISION = 0.7
AHEAD_SAMPLES = 16  # prefetches sent before their own precision replaces the prior
AHEAD_GAP_S = 0.25e-3  # time between two host nodes (the device's work), until measured


def unsupported_reason(layout: ExpertLayout, dtype: torch.dtype) -> str | None:
    """Why the native kernel cannot compute experts of this layout in this compute dtype (None: it can)."""
    if dtype not in (torch.bfloat16, torch.float32):
        return f"the native CPU kernel computes bfloat16 and float32 models, not {str(dtype).replace('torch.', '')}"
    names = {p.name: p for p in layout.pieces}
    biases = [names[n].dtype for n in ("gate_up_proj_bias", "down_proj_bias") if n in names]
    if any(b not in _DENSE_DTYPES for b in biases) or len(set(biases)) > 1:
        return "the expert biases are stored in a dtype the native CPU kernel does not read (bfloat16 / float32)"
    if layout.quantized:
        need = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
        if not all(n in names for n in need):
            return "the MXFP4 expert layout is not gpt-oss's"
        return None
    if "gate_up_proj" not in names or "down_proj" not in names:
        return "the dense expert layout is not gpt-oss's"
    if names["gate_up_proj"].dtype not in _DENSE_DTYPES or names["down_proj"].dtype != names["gate_up_proj"].dtype:
        return f"dense experts stored as {names['gate_up_proj'].dtype} are not read by the native CPU kernel (bfloat16 / float32)"
    return None


def rows_unsupported_reason(layout: ExpertLayout, dtype: torch.dtype) -> str | None:
    """Why the native kernel cannot compute Qwen3-MoE experts of this layout in this compute dtype
    (None: it can; RowsExpertRunner)."""
    if dtype not in (torch.bfloat16, torch.float32):
        return f"the native CPU kernel computes bfloat16 and float32 models, not {str(dtype).replace('torch.', '')}"
    names = {p.name: p for p in layout.pieces}
    if "gate_up_proj" not in names or "down_proj" not in names:
        return "the expert layout is not Qwen3-MoE's"
    wdt = names["gate_up_proj"].dtype
    if wdt not in (*_DENSE_DTYPES, torch.float8_e4m3fn) or names["down_proj"].dtype != wdt:
        return f"experts stored as {wdt} are not read by the native CPU kernel (bfloat16 / float32 / float8_e4m3fn)"
    scales = [names[n].dtype for n in ("gate_up_proj_scale_inv", "down_proj_scale_inv") if n in names]
    if (wdt == torch.float8_e4m3fn) != bool(scales) or any(d not in _DENSE_DTYPES for d in scales) or len(set(scales)) > 1:
        return "the FP8 block scales are stored in a way the native CPU kernel does not read (float32 / bfloat16)"
    return None


class CpuRunner:
    """What every CPU expert runner shares: the measured rate (weight bytes read per second, an
    EWMA kept current by every call; the CPU side of the placement cost model), the counters, and
    ``run_layer`` over ``run``. A subclass gives ``run`` (one expert, its rows) and may give a
    faster ``run_layer`` (every expert of a layer in one call)."""

    threads: int
    level: str
    tokens_per_read = 1 << 30  # tokens one read of the weights serves (the native kernel: 16)
    calibration_tokens: tuple[int, ...] = (1,)  # token counts calibrate() times (the native kernel: 1 .. 16)
    calibration_batch = 1  # experts per timed call of calibrate() (the native kernel: a layer's share, 4)

    def __init__(self, host: HostStore):
        self.host = host
        self.layout = host.layout
        self.expert_bytes = self.layout.payload_bytes  # what one read of an expert's weights moves
        self.rate_bps: float | None = None  # weight bytes per one-token call's second, kept current (EWMA)
        # seconds of a call over T tokens relative to one token's, as calibrated, in increasing T
        # (empty: 1 for any T up to tokens_per_read); between calibrated counts interpolated linearly
        self.token_cost: dict[int, float] = {}
        self._units_memo: tuple[dict[int, float] | None, dict[int, float]] = (None, {})
        self.experts = 0  # (layer, expert) computations
        self.tokens = 0  # token rows computed (a token counts once per expert)
        self.seconds = 0.0

    def _relative(self, tokens: int) -> float:
        """One call's cost over ``tokens`` (<= tokens_per_read) tokens, in one-token calls."""
        pts = list(self.token_cost.items())  # calibrate() fills it in increasing T
        if not pts or tokens <= pts[0][0]:
            return pts[0][1] if pts else 1.0
        for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
            if tokens <= t1:
                return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)
        return pts[-1][1]

    def _units(self, tokens: int) -> float:
        """One expert over ``tokens`` tokens in one-token calls: a call per tokens_per_read tokens,
        each at its calibrated relative cost. Memoised per token count for the current
        ``token_cost`` (which calibrate() replaces, never changes in place): a host step accounts
        every layer's experts after each step."""
        memo_of, memo = self._units_memo
        if memo_of is not self.token_cost:
            memo = {}
            self._units_memo = (self.token_cost, memo)
        got = memo.get(tokens)
        if got is None:
            full, rest = divmod(max(1, tokens), self.tokens_per_read)
            got = memo[tokens] = full * self._relative(self.tokens_per_read) + (self._relative(rest) if rest else 0.0)
        return got

    def _account(self, experts: int, tokens: int, units: float, dt: float) -> None:
        self.experts += experts
        self.tokens += tokens
        self.seconds += dt
        if dt > 0:
            r = self.expert_bytes * units / dt
            self.rate_bps = r if self.rate_bps is None else (1 - _EWMA) * self.rate_bps + _EWMA * r

    def account(self, expert_tokens: list[int], seconds: float) -> None:
        """Count a layer's experts computed elsewhere (a host step's host node: host_graph.py):
        ``expert_tokens`` the token rows of each expert, ``seconds`` the call's time."""
        if expert_tokens:
            n, tokens = len(expert_tokens), sum(expert_tokens)
            units = n * self._units(1) if tokens == n else sum(self._units(t) for t in expert_tokens)
            self._account(n, tokens, units, seconds)

    def set_invariant(self, on: bool) -> None:
        """Batch invariance of the calls from now on (speculative decoding's batch-invariant
        verify): a token's result the same whatever other tokens share its call. The native kernel
        switches between its kernels by token count (CpuExpertRunner); a runner through PyTorch
        (TorchCpuExperts) has no such switch of its own, nothing to set."""

    def run(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] on the host -> the expert's output [n, H] float32 (no routing weight)."""
        t0 = time.perf_counter()
        y = self._compute(layer, expert, x)
        self._account(1, x.shape[0], self._units(x.shape[0]), time.perf_counter() - t0)
        return y

    def run_layer(self, layer: int, experts: list[int], positions: dict[int, list[int]], K: int, x: torch.Tensor,
                  w_flat: torch.Tensor, out: torch.Tensor) -> None:
        """Weighted outputs of ``experts`` at their positions p = t*K + k: out[p] = w_flat[p] *
        expert(x[t]) (x [T, H] and w_flat [T*K] float32 on the host, out [T*K, H] float32; other
        rows untouched)."""
        for e in experts:
            pos = torch.tensor(positions[e])
            y = self.run(layer, e, x.index_select(0, pos // K))
            out.index_copy_(0, pos, y.mul_(w_flat[pos].unsqueeze(-1)))

    def _compute_many(self, experts: list[tuple[int, int]], x: torch.Tensor) -> None:
        """Compute each (layer, expert) over the rows x (calibrate()'s timed call; results dropped)."""
        for layer, expert in experts:
            self._compute(layer, expert, x)

    def prewake(self) -> None:
        """A layer call is coming (its routing is on its way); a runner with a thread pool that
        sleeps wakes it now (CpuExpertRunner). Nothing to do here."""

    def seconds_for(self, tokens: int) -> float | None:
        """Predicted seconds to compute one expert for ``tokens`` tokens (None before any measurement)."""
        if not self.rate_bps:
            return None
        return self.expert_bytes * self._units(tokens) / self.rate_bps

    def calibrate(self, repeats: int = 3) -> float:
        """Time a few calls on real experts for each of ``calibration_tokens`` (not counted in the
        statistics), each over ``calibration_batch`` distinct experts as a layer's call would be
        (:meth:`_compute_many`; the pool woken first): the best one-token time per expert sets the
        rate, the others the cost of T tokens relative to one (kept non-decreasing in T). Returns
        bytes/s of one-token calls."""
        n = self.host.num_layers * self.host.num_experts
        E = self.host.num_experts
        best: dict[int, float] = {}
        for k, tokens in enumerate(self.calibration_tokens):
            x = torch.zeros((tokens, self.hidden), dtype=self.calibration_dtype)
            for i in range(max(1, repeats)):
                first = ((k * repeats + i) * 7919) % n
                rows = sorted({(first + j * 104729) % n for j in range(min(self.calibration_batch, n))})
                self.prewake()  # as before a layer's call: the pool is awake when it comes
                t0 = time.perf_counter()
                self._compute_many([(r // E, r % E) for r in rows], x)
                dt = max(time.perf_counter() - t0, 1e-9) / len(rows)
                best[tokens] = min(best.get(tokens, dt), dt)
        one = best[min(best)]
        self.token_cost, top = {}, 1.0
        for tokens in sorted(best) if len(best) > 1 else ():
            top = max(top, best[tokens] / one)
            self.token_cost[tokens] = top
        self.rate_bps = self.expert_bytes / one
        return self.rate_bps

    def stats(self) -> dict:
        return {
            "threads": self.threads,
            "level": self.level,
            "experts": self.experts,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "gbps": self.rate_bps / 1e9 if self.rate_bps else None,
        }

    def reset_stats(self) -> None:
        self.experts = 0
        self.tokens = 0
        self.seconds = 0.0

    def close(self) -> None:
        pass


_WEIGHT_POINTERS = ("gate_up", "gate_up_scales", "gate_up_bias", "down", "down_scales", "down_bias")


class CpuExpertRunner(CpuRunner):
    """The native CPU kernel bound to one host store of gpt-oss experts. Not thread-safe beyond the
    kernel's own serialization: one runner per computing thread."""

    host_steps = True  # its layers can run as host steps (offload/host_graph.py: gpt-oss's fused layer)

    tokens_per_read = 16  # the kernel reads the weights once per 16 tokens
    calibration_batch = 4  # a layer's call computes several experts at once (top-k's worth)
    # its cost grows with the tokens (AVX-512: each token's dot products; AMX: about flat from 4 tokens)
    calibration_tokens = (1, 2, 4, 8, 16)
    calibration_dtype = torch.float32
    # Threads woken when a layer's routing is on its way poll this long for the layer's call
    # (prewake); 0: they sleep until the call. Measured on the H200 host: see docs/benchmarks.md.
    prewake_us = 500

    def __init__(self, host: HostStore, alpha: float, limit: float, threads: int | None = None, level: str | None = None,
                 dtype: torch.dtype = torch.float32):
        from pdflash.native.cpu_experts import MAX_TOKENS, CpuExperts

        super().__init__(host)
        self.alpha = float(alpha)
        self.limit = float(limit)
        self.round_bf16 = dtype == torch.bfloat16  # a bf16 model rounds every step: so does the kernel then
        if dtype == torch.bfloat16:  # its inputs arrive in bf16 (the kernels that take bf16 inputs, AMX among them)
            self.calibration_dtype = torch.bfloat16
        self.kernel = CpuExperts(threads=threads, level=level)
        self.threads = self.kernel.threads
        self.fetch_threads = self.threads  # the threads that work while fetches may run (use_threads)
        self._working = self.threads  # the pool's active count, as last set
        self._invariant = False  # the kernel's batch invariance, as last set (set_invariant)
        self.level = self.kernel.level
        self.max_tokens = MAX_TOKENS
        self._weights: dict[tuple[int, int], object] = {}
        self._structs: dict[int, object] = {}  # host row -> the kernel's struct viewing it
        self._template: tuple[int, object] | None = None  # (row, struct) the others are shifted from
        self._slot_weights: dict[int, object] = {}
        self._slots_ptr = None
        self.hidden = self._hidden()

    def _hidden(self) -> int:
        lay = self.layout
        return lay.piece("down_proj_blocks").shape[0] if lay.quantized else lay.piece("down_proj").shape[1]

    def set_invariant(self, on: bool) -> None:
        """The kernel's batch invariance (CpuExperts.set_invariant: no AMX tiles for experts of
        several tokens while on), set only when it changes: every step of a decoder asks."""
        on = bool(on)
        if on != self._invariant:
            self.kernel.set_invariant(on)
            self._invariant = on

    def share_with_fetches(self, threads: int) -> None:
        """From now on only ``threads`` of the pool's threads work (the others sleep), except in
        :meth:`use_threads` windows that ask for all: the cores left over are the scheduler's copy
        workers' while fetches may run."""
        self.fetch_threads = max(1, min(int(threads), self.threads))
        self.use_threads(False)

    def use_threads(self, every: bool) -> None:
        """Every pool thread (``every``: a step that fetches nothing, e.g. a host step of the host
        arm) or the share left beside fetches (:meth:`share_with_fetches`)."""
        n = self.threads if every else self.fetch_threads
        if n != self._working:
            self.kernel.set_active(n)
            self._working = n

    def stats(self) -> dict:
        return {**super().stats(), "fetch_threads": self.fetch_threads}

    def _row_weights(self, row: torch.Tensor):
        """ExpertWeights viewing one packed row (host store row or cache slot; no copy)."""
        from pdflash.native.cpu_experts import ExpertWeights

        v = lambda name: self.layout.view(row, name)  # noqa: E731
        if self.layout.quantized:
            return ExpertWeights.mxfp4(v("gate_up_proj_blocks"), v("gate_up_proj_scales"), v("gate_up_proj_bias"),
                                       v("down_proj_blocks"), v("down_proj_scales"), v("down_proj_bias"),
                                       alpha=self.alpha, limit=self.limit, round_bf16=self.round_bf16)
        return ExpertWeights.dense(v("gate_up_proj"), v("gate_up_proj_bias"), v("down_proj"), v("down_proj_bias"),
                                   alpha=self.alpha, limit=self.limit, round_bf16=self.round_bf16)

    def weights(self, layer: int, expert: int):
        key = (layer, expert)
        w = self._weights.get(key)
        if w is None:
            w = self._weights[key] = self._row_weights(self.host.row(layer, expert))
        return w

    def struct(self, layer: int, expert: int):
        """The kernel's weights struct (``pf_cpu_weights``) for the host row of (layer, expert).
        Every row has the same layout, so only the first is built (and checked) through
        ExpertWeights; each other one is a copy of it with its pointers moved by the distance
        between the rows: microseconds, where a 120b model's first decode steps meet thousands
        of experts for the first time."""
        r = self.host.row_index(layer, expert)
        s = self._structs.get(r)
        if s is not None:
            return s
        ffi = self.kernel.ffi
        if self._template is None:
            s = self.weights(layer, expert).struct(ffi)  # kept alive by the ExpertWeights in _weights
            self._template = (r, s)
        else:
            r0, t = self._template
            delta = (r - r0) * self.host.buf.stride(0)
            s = ffi.new("pf_cpu_weights *", t[0])
            for name in _WEIGHT_POINTERS:
                p = getattr(t, name)
                if p != ffi.NULL:
                    setattr(s, name, ffi.cast(ffi.typeof(p), int(ffi.cast("uintptr_t", p)) + delta))
        self._structs[r] = s
        return s

    def slot_weights(self, slots: torch.Tensor, slot: int):
        """ExpertWeights viewing cache slot ``slot`` of ``slots`` (host memory: the CPU device).
        The views stay valid while ``slots`` lives; whichever expert the slot holds is read."""
        if self._slots_ptr != slots.data_ptr():
            self._slot_weights.clear()
            self._slots_ptr = slots.data_ptr()
        w = self._slot_weights.get(slot)
        if w is None:
            w = self._slot_weights[slot] = self._row_weights(slots[slot])
        return w

    def _compute(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.forward(self.weights(layer, expert), x)

    def _compute_many(self, experts: list[tuple[int, int]], x: torch.Tensor) -> None:
        """Every expert over every row of x in one native call, as a layer's call runs them."""
        T, b = x.shape[0], len(experts)
        out = torch.empty((b * T, self.hidden), dtype=torch.float32)
        self.kernel.call_many([self.struct(layer, e) for layer, e in experts], [T] * b, list(range(T)) * b,
                              list(range(b * T)), [1.0] * (b * T), x, out)

    def prewake(self) -> None:
        """A layer call is coming (its routing is on its way): wake the pool to wait for it."""
        if self.prewake_us:
            self.kernel.prewake(self.prewake_us)

    def run_layer(self, layer: int, experts: list[int], positions: dict[int, list[int]], K: int, x: torch.Tensor,
                  w_flat: torch.Tensor, out: torch.Tensor) -> None:
        """As :meth:`CpuRunner.run_layer`, in one native call: gathering the rows, the routing
        weights and the scatter into ``out`` happen in C, one pool hand-off per phase."""
        t0 = time.perf_counter()
        counts = self._forward([(self.struct(layer, e), positions[e]) for e in experts], K, x, w_flat, out)
        if counts:
            self._account(len(experts), sum(counts), sum(self._relative(c) for c in counts), time.perf_counter() - t0)

    def run_slots(self, slots: torch.Tensor, batch: list[tuple[int, int]], positions: dict[int, list[int]], K: int,
                  x: torch.Tensor, w_flat: torch.Tensor, out: torch.Tensor) -> None:
        """As :meth:`run_layer` for experts that sit in cache slots on the CPU device: ``batch``
        [(expert, slot)], read from the slot rows. Not counted as host-path experts: these are
        the cache's own (hits and arrivals), computed natively instead of dequantized by torch."""
        ffi = self.kernel.ffi
        self._forward([(self.slot_weights(slots, s).struct(ffi), positions[e]) for e, s in batch], K, x, w_flat, out)

    def _forward(self, items: list, K: int, x: torch.Tensor, w_flat: torch.Tensor, out: torch.Tensor) -> list[int]:
        """items [(weights struct, positions)] in one native call, at most max_tokens rows per
        expert call -> the token rows of each expert call. Plain lists, no tensor built per call."""
        structs, counts, dest = [], [], []
        m = self.max_tokens
        for s, pos in items:
            for i in range(0, len(pos), m):
                chunk = pos[i: i + m]
                structs.append(s)
                counts.append(len(chunk))
                dest += chunk
        if not structs:
            return []
        w = w_flat.tolist()
        self.kernel.call_many(structs, counts, [p // K for p in dest], dest, [w[p] for p in dest], x, out)
        return counts

    def close(self) -> None:
        self.kernel.close()
        self._structs.clear()
        self._template = None
        self._weights.clear()
        self._slot_weights.clear()


class RowsExpertRunner(CpuExpertRunner):
    """The native CPU kernel bound to one host store of Qwen3-MoE experts (pf_cpu.h's row formats:
    gate_up [2I, H] and down [H, I] rows in bf16 / float32, or FP8 with block scales; SiLU-gated).
    Everything but the weights is CpuExpertRunner's; host steps stay gpt-oss's."""

    host_steps = False

    def __init__(self, host: HostStore, threads: int | None = None, level: str | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__(host, alpha=0.0, limit=0.0, threads=threads, level=level, dtype=dtype)

    def _hidden(self) -> int:
        return self.layout.piece("down_proj").shape[0]

    def _row_weights(self, row: torch.Tensor):
        from pdflash.native.cpu_experts import ExpertWeights

        v = lambda name: self.layout.view(row, name)  # noqa: E731
        fp8 = self.layout.quantized
        return ExpertWeights.rows(v("gate_up_proj"), v("down_proj"), v("gate_up_proj_scale_inv") if fp8 else None,
                                  v("down_proj_scale_inv") if fp8 else None, round_bf16=self.round_bf16)


GUARD_ARMS = ("off", "all", "model", "host")  # the default order of a check
HOST_FIRST_FACTOR = 2.0  # with host steps: host arms first unless the link moves an expert this many times sooner
HOST_FIRST_FACTOR_SEGMENTED = 0.5  # the same where the host arms' layers run between graph segments


def guard_order(host_expert_s: float | None, fetch_expert_s: float, host_steps: bool = False,
                segmented: bool = False) -> tuple[str, ...]:
    """The order a guard checks its arms in. The first arm's window always runs in full, the
    others' end early when they measure far behind (``HybridGuard.abandon``), so the arm most likely
    to win goes first: the host arms unless the link moves an expert ``factor`` times sooner than
    the calibrated kernel computes a one-token one, fetch-only first then. Among the host arms,
    "host" leads where its steps run as host steps (``host_steps``: CUDA graphs with the fused
    kernel), "all" elsewhere. ``segmented``: the host arms' layers run between graph segments on
    a GPU (CUDA without host steps), each layer with CPU work handed to the host and back.

    The cost model's per-layer split ranks "model" best wherever both pipes are open, but the
    steps measured on GPU hosts (docs/benchmarks.md) rank the whole-step host graphs first: "all"
    until session 25; since the hits' kernel runs beside the host node (session 26), "host" ahead
    of "all" (the same CPU work less the hits) at full link speed and on the emulated desktop. The
    order goes by those measurements, not by the split's prediction.

    The factor, with host steps (``HOST_FIRST_FACTOR``): a fetch costs a step more than its bytes
    over the link's rate (a demand wait, a graph segment per layer) while a host step is one
    graph, so near a tie the host arms win. On the embedded pair's GPU runs (``--link-gbps 2``)
    the kernel calibrated 2.8-3.2 GB/s (session 37), yet the fetch-only arm's steps took 4-8 ms
    against 1.3-2.2 ms for the host arm; in session 40 four of eight default runs and one of eight
    ``--no-draft`` runs began with fetch-only (a calibration under the link's rate, by the per-step
    traces), and their first 7-8 steps took 3-6 ms instead of 1.3-1.7. The CPU device calls the
    kernel directly and takes the same factor.

    Segmented (``HOST_FIRST_FACTOR_SEGMENTED``), the host arms pay a hand-off per layer with CPU
    work (the layer's rows to the host and back, a segment boundary) that the per-expert rates do
    not see: only a kernel twice as fast an expert as the link leads. Qwen3-30B-A3B-shaped FP8
    experts on H100 hosts (4.7 MB; sessions 42-43): the kernel 0.16-0.21 ms an expert, the link
    0.19 ms (25 GB/s, timed at load by ``OffloadedModel._probe_link``), yet "all" took 64-78 ms a
    step, "host" 36-74 (about 97 CPU experts a token over 48 layers), fetch-only 25-37. With the
    host arms first their windows cost 37-47 % of 48 tokens; fetch-only first, `auto` ran 0.96x
    fetch-only, keeping the split ("model"). gpt-oss-20b's experts without host steps (sessions
    5-6, H200 host; 13 MB, the kernel 0.16-0.22 ms, the link about 0.24): "all" 1.3-1.6x
    fetch-only. A fetch-only start still tries the host arms: the guard keeps the arm its steps
    measure best, and a wrong first arm costs its window."""
    factor = HOST_FIRST_FACTOR_SEGMENTED if segmented and not host_steps else HOST_FIRST_FACTOR
    if host_expert_s is not None and host_expert_s < factor * fetch_expert_s:
        return ("host", "all", "model", "off") if host_steps else ("all", "host", "model", "off")
    return GUARD_ARMS


class HybridGuard:
    """Which placement pays on this machine now, judged by the decode steps it realizes.

    The cost model prices one layer's split; it does not see what host compute does to the rest
    of a step: the kernel's DRAM reads compete with the link's DMA for the same memory, its
    threads with the decoding thread and the scheduler's copy workers, its results with the
    interpreter lock. So placements ("arms") are checked against measured step times:

    - "off": every miss is fetched (no host path);
    - "all": every routed expert, hits too, is computed on the CPU (the layer takes the path of
      ``--cpu-experts all``: no cache lookup, no fetch, the device only runs attention);
    - "model": the per-layer cost model splits each layer's misses between the link and the CPU;
    - "host": every miss not already on its way is computed on the CPU (hits stay on the device;
      nothing is brought into the cache, so no DMA competes with the kernel's DRAM reads; the
      cache keeps what the other arms' windows brought in until the next check).

    Steps (forwards of up to ``max_tokens`` tokens: decode steps and speculative decoding's
    verify blocks) run in windows of ``window`` steps, one arm per window in turn (the first step
    of a window is not counted: it pays the switch). A step lasts from its forward's start to the
    next forward's start, and is compared only with steps of as many tokens: an arm's time is the
    mean over token counts, weighted by how often each count ran in the check, of its median step
    at each count measured under every arm still in the check (:meth:`_times`); a round whose arms
    share no token count does not end the check (after ``4 * rounds`` such rounds, each arm's
    steps are pooled whatever their tokens). After each round of windows, arms whose time is more
    than ``cut`` behind the best leave the check; the check ends after ``rounds`` rounds or when
    one arm is left. The arm with the lowest time is kept ("off" unless another is faster by more
    than ``margin``) for ``hold`` decode steps, then checked again the same way; a check that
    confirms the same arm doubles the hold, up to ``max_hold``. A window whose first counted step
    is more than ``abandon`` slower than the best median another arm still in the check measured at
    that token count ends at once, and its arm leaves the check with that step as its time (an arm
    far behind costs two steps, not a window; None: windows always run in full). A window's
    uncounted first step ends it the same way when it alone is ``switch_abandon`` times further
    behind than that (None: never): on the embedded pair's GPU runs (``--link-gbps 2``) the
    fetch-only arm's first step took 11-17 ms and its next 4-8 ms against 1.3-2.2 ms for the host
    arms (sessions 37 and 40), so it cost two slow steps where one tells. The ``settle``
    steps after a longer forward (a prefill) are not counted and run the current arm: the first
    decode steps after a prefill measured about twice their steady time under whichever arm came
    first (GPU hosts, sessions 23-24); the runtime calls ``on_sequence()`` when a sequence starts
    (the gap before its prompt is no step, and its first ``settle`` steps settle). A check after a hold (a
    re-check) opens with the kept arm and tries only the arms whose last median was within
    ``recheck`` of the best: arms measured far behind are not paid for again at every hold. If
    the re-check's best is more than ``recheck`` slower than the last check's best (the host or
    the link changed), a full check of every arm follows at once. ``on_forward(tokens)`` is a
    forward observer of the runtime.

    A short sequence cannot pay for a check: one announced with fewer than :attr:`min_steps`
    steps (``on_sequence(steps)``; a ``generate`` of a few tokens) runs the first arm, the one the
    order ranks best, unchecked, as long as no check has completed and the short sequences so
    far have run fewer than ``min_steps`` steps in all; after that a check runs across short
    sequences as across long ones (its windows continue where the last sequence stopped).

    The arm rules the forwards it is judged by. A longer forward (a prefill, perhaps a later
    ``generate`` on the same runtime) reads each expert's weights once per 16 tokens on the CPU
    and is priced by the cost model's split instead (:meth:`arm_for`), whichever arm the steps keep."""

    def __init__(self, window: int = 4, rounds: int = 2, hold: int = 64, max_hold: int = 1024, margin: float = 0.02,
                 cut: float = 0.05, recheck: float = 0.25, arms: tuple[str, ...] = GUARD_ARMS,
                 clock: Callable[[], float] = time.perf_counter, max_tokens: int = 16, abandon: float | None = 0.5,
                 settle: int = 4, trace: int = 0, switch_abandon: float | None = 3.0):
        if (window < 2 or rounds < 1 or hold < 1 or cut < 0 or recheck < 0 or max_tokens < 1 or settle < 0 or trace < 0
                or (abandon is not None and abandon < 0) or (switch_abandon is not None and switch_abandon < 1)):
            raise ValueError("window >= 2, rounds >= 1, hold >= 1, cut >= 0, recheck >= 0, abandon >= 0, settle >= 0, "
                             "trace >= 0, max_tokens >= 1 and switch_abandon >= 1 are needed")
        arms = tuple(arms)
        if "off" not in arms or len(arms) < 2 or len(set(arms)) != len(arms) or any(a not in GUARD_ARMS for a in arms):
            raise ValueError(f"arms: two or more distinct of {GUARD_ARMS}, 'off' among them")
        self.window, self.rounds, self.margin, self.cut, self.recheck, self.arms = window, rounds, margin, cut, recheck, arms
        self.abandon, self.switch_abandon = abandon, switch_abandon
        self.abandoned = 0  # windows ended early (arms far behind)
        self.settle = settle
        self._settling = 0  # steps still to pass uncounted after a longer forward
        self.trace_limit = trace
        self.trace: list[tuple[str, int, float, str]] = []  # the first ``trace`` steps: (arm, tokens, ms, what)
        self.hold, self.max_hold, self._first_hold = hold, max_hold, hold
        self.clock = clock
        self.max_tokens = max_tokens
        self.checks = 0  # completed comparisons
        self.full_checks = 0  # completed checks that tried every arm
        self._medians: dict[str, float] = {}  # latest median step (s) of each arm measured
        self._best = 0.0  # the best median of the last completed check
        self._choice: str | None = None
        self._pinned = False  # pin(): one arm kept, nothing checked
        self._pin_longer = False  # pin(longer=True): the pinned arm rules prefills too
        self._prev: tuple[float, int] | None = None  # (start, tokens) of the previous forward
        self._short = False  # this sequence runs the first arm unchecked (on_sequence)
        self.short_steps = 0  # steps run unchecked by short sequences
        self._start_check()

    @property
    def enabled(self) -> bool:
        """The host path is in use now (any arm but "off")."""
        return self.arm != "off"

    @property
    def pinned(self) -> bool:
        """One arm is kept for good (:meth:`pin`): nothing is checked."""
        return self._pinned

    @property
    def short(self) -> bool:
        """This sequence runs the first arm unchecked (:meth:`on_sequence`)."""
        return self._short

    @property
    def kept(self) -> int | None:
        """None while the first check runs (no arm kept yet, the arms take turns); else the checks
        that have kept an arm so far (0 for a pinned guard or a short sequence's unchecked arm).
        A new value: the steps from now on run another kept arm (the block planner measures its
        step times afresh)."""
        if self._pinned or self._short:
            return 0
        return self.checks or None

    def arm_for(self, tokens: int) -> str:
        """The placement of a forward of ``tokens`` tokens: the kept (or tried) arm where the
        guard's measurements speak for it, the cost model's split ("model") for longer ones
        (unless pinned with ``longer=True``)."""
        return self.arm if tokens <= self.max_tokens or self._pin_longer else "model"

    def _start_check(self, full: bool = True) -> None:
        if full or self._choice is None:
            self._live = list(self.arms)  # arms still in the check
        else:  # a re-check: the kept arm first, then the arms last measured near the best
            near = [a for a in self.arms if a != self._choice and a in self._medians
                    and self._medians[a] <= self._best * (1 + self.recheck)]
            self._live = [self._choice] + near
        self._full = len(self._live) == len(self.arms)
        self._round = 0
        self._turn = 0  # index into _live of the arm whose window runs
        self._window_steps = 0
        self._samples: dict[str, dict[int, list[float]]] = {a: {} for a in self.arms}  # arm -> tokens -> step seconds
        self._idle_rounds = 0  # rounds whose arms shared no token count
        self._check_times: dict[str, float] = {}  # arm -> step time at the end of its last round (_times)
        self._holding = 0  # decode steps left in the hold (0: checking)
        self.arm = self._live[0]

    def pin(self, arm: str, longer: bool = False) -> None:
        """Keep ``arm`` from now on, checking nothing (benchmarks measure one arm's steady steps);
        with ``longer`` it rules the longer forwards (prefills) too: ``pin("off", longer=True)`` is
        fetch-only throughout."""
        if arm not in self.arms:
            raise ValueError(f"arm {arm!r} is not one of {self.arms}")
        self.arm, self._pinned, self._pin_longer = arm, True, longer

    def unpin(self) -> None:
        """Forget any pinned or kept arm and check every arm from the next step, as a new guard does."""
        self._pinned, self._pin_longer, self._choice, self._prev = False, False, None, None
        self._short, self.short_steps = False, 0
        self.hold = self._first_hold
        self._start_check()

    def on_forward(self, tokens: int) -> None:
        now = self.clock()
        prev, self._prev = self._prev, (now, tokens)
        if tokens > self.max_tokens:
            self._settling = self.settle
        if prev is None or prev[1] > self.max_tokens or tokens > self.max_tokens:
            return  # after a prefill, or before one (the gap may hold anything): not a step
        self._step(now - prev[0], prev[1])

    @property
    def min_steps(self) -> int:
        """The fewest steps a sequence needs to be checked in: two rounds of every arm's window
        after the settle steps."""
        return 2 * (self.settle + self.window * len(self.arms))

    def on_sequence(self, steps: int | None = None) -> None:
        """A new sequence starts, of at most ``steps`` decode steps (None: unknown): the gap since
        the last forward is no step, and its first ``settle`` steps are not counted. A short one
        may run the first arm unchecked (see the class docstring)."""
        self._prev = None
        self._settling = self.settle
        was = self._short
        self._short = (steps is not None and steps < self.min_steps and not self._pinned and self.checks == 0
                       and self.short_steps < self.min_steps)
        if self._short:
            self.arm = self.arms[0]
        elif was and not self._pinned:  # back to the check where it stopped; its window starts again
            self.arm = self._live[self._turn] if not self._holding else self._choice
            self._window_steps = 0

    def _note(self, tokens: int, seconds: float, what: str) -> None:
        if len(self.trace) < self.trace_limit:
            self.trace.append((self.arm, tokens, round(seconds * 1e3, 3), what))

    def _step(self, seconds: float, tokens: int) -> None:
        """One step of ``tokens`` tokens ran with the current arm and took ``seconds``."""
        if self._pinned:
            self._note(tokens, seconds, "pinned")
            return
        if self._short:
            self._note(tokens, seconds, "unchecked")
            self.short_steps += 1
            return
        settling = self._settling > 0
        self._settling -= settling
        if self._holding:
            self._note(tokens, seconds, "held")
            self._holding -= 1
            if not self._holding:
                self._start_check(full=False)
            return
        if settling:
            self._note(tokens, seconds, "settling")
            return
        self._note(tokens, seconds, "counted" if self._window_steps else "switch")
        if self._window_steps:  # the window's first step pays the switch
            self._samples[self.arm].setdefault(tokens, []).append(seconds)
        if self._far_behind(seconds, tokens, self.switch_abandon if not self._window_steps else 1.0):
            self._check_times[self.arm] = seconds
            self.abandoned += 1
            del self._live[self._turn]
            self._turn -= 1
            self._next_window()
            return
        self._window_steps += 1
        if self._window_steps < self.window:
            return
        self._next_window()

    def _far_behind(self, seconds: float, tokens: int, factor: float | None) -> bool:
        """The current arm's step of ``tokens`` tokens is more than ``factor`` times ``1 +
        abandon`` the best median another live arm measured at that count in this check."""
        if self.abandon is None or factor is None or len(self._live) < 2:
            return False
        others = [_median(self._samples[a][tokens]) for a in self._live
                  if a != self.arm and self._samples[a].get(tokens)]
        return bool(others) and seconds > min(others) * (1 + self.abandon) * factor

    def _next_window(self) -> None:
        """The current arm's window is over: the next live arm's, or the end of the round."""
        self._window_steps = 0
        self._turn += 1
        if self._turn < len(self._live):
            self.arm = self._live[self._turn]
            return
        med = self._times(self._live)
        if med is None and self._idle_rounds < 4 * self.rounds:  # nothing comparable yet: another round
            self._idle_rounds += 1
            self._turn = 0
            self.arm = self._live[0]
            return
        med = med or self._times(self._live, pooled=True)
        self._check_times.update(med)  # an arm that leaves keeps its time of the last round it ran
        self._round += 1  # a round ended: the arms far behind leave
        best = min(med.values())
        self._live = [a for a in self._live if med[a] <= best * (1 + self.cut)]
        if self._round < self.rounds and len(self._live) > 1:
            self._turn = 0
            self.arm = self._live[0]
            return
        self._decide()

    def _times(self, arms: list[str], pooled: bool = False) -> dict[str, float] | None:
        """Each arm's step time: over the token counts measured under every one of ``arms``, the
        mean of its median step at each count, weighted by those arms' steps at the count (None:
        no count is shared). ``pooled``: each arm's steps as one count, whatever their tokens."""
        by_arm = {a: ({0: [x for xs in self._samples[a].values() for x in xs]} if pooled else self._samples[a])
                  for a in arms}
        common = set.intersection(*({t for t, xs in v.items() if xs} for v in by_arm.values()))
        if not common:
            return None
        weight = {t: sum(len(v[t]) for v in by_arm.values()) for t in common}
        total = sum(weight.values())
        return {a: sum(weight[t] * _median(v[t]) for t in common) / total for a, v in by_arm.items()}

    def _decide(self) -> None:
        med = dict(self._check_times)
        live = {a: med[a] for a in self._live}
        best = min(live, key=live.__getitem__)
        if best != "off" and "off" in live and live[best] >= live["off"] * (1 - self.margin):
            best = "off"  # not enough faster to be worth the host path
        drifted = not self._full and live[best] > self._best * (1 + self.recheck)
        if self.checks and best == self._choice and not drifted:
            self.hold = min(self.max_hold, 2 * self.hold)
        self._choice = best
        self.checks += 1
        self.full_checks += self._full
        self._medians.update(med)
        self._best = live[best]
        if drifted:  # the steps got slower than the arms were measured: measure every arm again
            self.hold = self._first_hold
            self._start_check(full=True)
            return
        self.arm = best
        self._holding = self.hold

    def stats(self) -> dict:
        medians = {f"{a}_ms": (self._medians[a] * 1e3 if a in self._medians else None) for a in self.arms}
        return {"arm": self.arm, "host_path": self.enabled, "checks": self.checks, "full_checks": self.full_checks,
                "abandoned_windows": self.abandoned, **medians, "hold_steps": self.hold,
                "short_sequence": self._short, "unchecked_steps": self.short_steps,
                "trace": [{"arm": a, "tokens": t, "ms": ms, "counted": how} for a, t, ms, how in self.trace]}


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class CpuPlacement:
    """The per-layer decision of hybrid execution (``cpu_experts="auto"`` with a link):
    ``placer(layer, misses, positions, K, arm) -> experts to compute on the CPU``, where ``arm``
    is ``arm(tokens)`` of the forward, worked out once by the experts module.

    Reads the shared cost model (offload/cost.py): the link rate from the scheduler's own
    statistics (observed at most every ``observe_every_s``), the CPU kernel's rate (the
    runner's calibrated, kept-current EWMA, installed as the model's host hook), the layer's
    in-flight experts and its resident ones. Experts computed on the CPU that are hot (used
    at least ``hot_uses`` times within the last ``hot_window`` forwards) are still brought
    into the cache in the background band, so the cache keeps the hot set. With a ``guard``
    (:class:`HybridGuard`), its arm decides: the cost model's split, nothing on the CPU, every
    miss not in flight on the CPU (then without background fetches), or every routed expert on
    the CPU (arm "all": the experts module then takes its "all" path and does not ask). A forward
    longer than the guard judges takes the cost model's split (``HybridGuard.arm_for``).
    """

    def __init__(self, cache, scheduler, runner: CpuExpertRunner, cost, hot_uses: int = 2, hot_window: int = 8,
                 background_band: int = 2, observe_every_s: float = 0.05, guard: HybridGuard | None = None):
        self.cache = cache
        self.scheduler = scheduler
        self.runner = runner
        self.cost = cost
        self.hot_uses = hot_uses
        self.hot_window = hot_window
        self.background_band = background_band
        self.observe_every_s = observe_every_s
        self.guard = guard
        self._last_observe = 0.0
        self._uses: dict[tuple[int, int], deque] = {}  # (layer, expert) -> forwards that needed it off-cache
        self.decisions = 0
        self.background = 0  # hot CPU experts queued into the cache
        cost.set_cpu_expert_rate(runner.seconds_for, placement=self.arm)

    def arm(self, tokens: int) -> str:
        """The placement of a forward of ``tokens`` tokens ("model" without a guard)."""
        return self.guard.arm_for(tokens) if self.guard is not None else "model"

    def _observe(self) -> None:
        now = time.perf_counter()
        if now - self._last_observe >= self.observe_every_s:
            self.cost.observe_scheduler(self.scheduler.stats())
            self._last_observe = now

    def fetch_plan(self, tokens: int, top_k: int, stages: int) -> list[int]:
        """For a host step's layers (host_graph.py, mode "split"): ``plan[M]``, M = 0 .. tokens *
        top_k, the experts to fetch when M distinct routed experts are not resident, by the cost
        model's per-layer split (:meth:`CostModel.place_layer`) with the tokens spread evenly over
        them; at most ``stages``."""
        self._observe()
        n = tokens * top_k
        plan = [0]
        for m in range(1, n + 1):
            per = max(1, n // m)
            plan.append(min(stages, len(self.cost.place_layer({e: per for e in range(m)}).fetch)))
        self.decisions += 1
        return plan

    def split_plan(self, tokens: int, top_k: int, stages: int, num_experts: int, gap_s: float | None,
                   route_ahead: bool) -> tuple[list[int], int]:
        """For a host step's layers in mode "split": (``plan``, m). Without ``route_ahead``, or
        where it does not pay, the cost model's in-layer plan (:meth:`fetch_plan`) and m = 0.
        With it, when the cost model's route-ahead (:meth:`CostModel.ahead_layer`: m of the next
        layer's predicted experts prefetched by each host node, at most ``stages // 2``) finishes
        a layer sooner than the in-layer plan: a plan that fetches nothing (the link carries the
        prefetches) and that m. Its inputs: the share of routed experts not resident (the
        statistics so far; before any, the cache's share of all experts), the expected distinct
        experts a layer of ``tokens`` tokens routes to (uniform routing), the prefetches'
        precision (claimed / sent once ``AHEAD_SAMPLES`` were sent; ``AHEAD_PRECISION`` before)
        and ``gap_s``, the measured time between two host nodes (``AHEAD_GAP_S`` before)."""
        plan = self.fetch_plan(tokens, top_k, stages)
        if not route_ahead:
            return plan, 0
        fs = self.cache.stats
        served = fs.hits + fs.misses + fs.cpu
        if served:
            share = (fs.misses + fs.cpu) / served
        else:
            share = 1.0 - self.cache.capacity / max(1, fs.num_layers * num_experts)
        distinct = num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)
        missing = distinct * max(0.0, share)
        per = max(1, round(tokens * top_k / max(distinct, 1.0)))
        precision = (fs.route_ahead_used / fs.route_ahead_sent if fs.route_ahead_sent >= AHEAD_SAMPLES
                     else AHEAD_PRECISION)
        most = min(stages // 2, max(0, round(distinct)))
        m, ahead_s = self.cost.ahead_layer(missing, precision, per, AHEAD_GAP_S if gap_s is None else gap_s, most)
        if m == 0 or ahead_s is None:
            return plan, 0
        in_layer = self.cost.place_layer({e: per for e in range(max(1, round(missing)))}).seconds
        if ahead_s >= in_layer:
            return plan, 0
        return [0] * len(plan), m

    def note_host(self, layer: int, experts: list[int]) -> None:
        """Experts of ``layer`` a forward computed on the CPU: those used ``hot_uses`` times within
        ``hot_window`` forwards are queued into the cache in the background band."""
        forward = self.cache.stats.forwards
        for e in experts:
            uses = self._uses.setdefault((layer, e), deque(maxlen=self.hot_uses))
            uses.append(forward)
            if len(uses) == self.hot_uses and forward - uses[0] < self.hot_window:
                if self.cache.prefetch(layer, e, self.background_band):
                    self.background += 1

    def __call__(self, layer: int, misses: list[int], positions: dict[int, list[int]], K: int,
                 arm: str) -> list[int]:
        self._observe()
        in_flight, missing = 0, {}
        for e in misses:
            if self.cache.state_of(layer, e) == "arriving":
                in_flight += 1
            else:
                missing[e] = len(positions[e])
        if arm == "off":  # never "all" here: such forwards take the experts module's all path
            return []
        if arm == "host":  # every miss not already on its way
            host = sorted(missing)
        else:
            miss_set = set(misses)
            resident = [len(p) for e, p in positions.items() if e not in miss_set]
            host = self.cost.place_layer(missing, in_flight=in_flight, resident_tokens=resident).host
        self.decisions += 1
        if arm == "model":  # not "host": there the CPU serves every miss, no link traffic competes with its reads
            self.note_host(layer, host)
        return host


def resolve_mode(mode: str) -> str:
    if mode not in CPU_EXPERT_MODES:
        raise PdflashError(f"unknown --cpu-experts {mode!r}: use {', '.join(CPU_EXPERT_MODES)}")
    return mode
