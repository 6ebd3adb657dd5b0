"""OffloadedModel: a loaded MoE checkpoint whose experts live in host memory.

    with OffloadedModel.load("ckpt/", device="cuda", expert_cache_mib=2600, lookahead_depth=1) as rt:
        out = rt.forward(input_ids, cache=rt.new_kv_cache())
        print(rt.stats()["exposed_fetch_seconds"])

``rt.model`` is the library's own model (transformers GptOssForCausalLM or Qwen3MoeForCausalLM, as
the checkpoint's family adapter ``rt.family`` builds it) with each
layer's experts swapped for :class:`OffloadedExperts`; it is used like the
library model, with its own KV cache (DynamicCache, cropping included).
``rt.scheduler`` is the one native Scheduler that moves every expert byte,
``rt.cache`` the device expert cache, ``rt.prefetcher`` the ExpertPrefetcher.
``reset_cache()`` is not terminal; ``close()`` is.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Callable, Iterator

import torch

from pdflash import PdflashError
from pdflash.native import Band, Scheduler, SchedulerError
from pdflash.offload.cache import DEFAULT_EVICTION, EVICTION_POLICIES, ExpertCache
from pdflash.offload.checkpoint import Checkpoint
from pdflash.offload.cpu_compute import resolve_mode
from pdflash.offload.experts import OffloadedExperts
from pdflash.offload.host_store import HostStore
from pdflash.offload.host_exchange import HostExchange
from pdflash.offload.prefetch import ExpertPrefetcher
from pdflash.offload.stats import band_name

LINK_GBPS_MIN, LINK_GBPS_MAX = 1e-3, 1e4  # a simulated link from 1 MB/s to 10 TB/s
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise PdflashError(f"unknown device {device!r}: use cpu or cuda[:N]", exit_code=2) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise PdflashError("--device cuda was asked for but no CUDA device is available (CPU-only PyTorch?); use --device cpu")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise PdflashError(f"{dev} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu":
        raise PdflashError(f"device {dev.type!r} is not supported: use cpu or cuda", exit_code=2)
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise PdflashError(f"unknown dtype {dtype!r}: use auto, bfloat16, float16 or float32", exit_code=2) from None


def min_cache_experts(num_experts: int, top_k: int, block_tokens: int) -> int:
    """Fewest slots the cache may have: what one layer may need at once in a decode block."""
    return min(num_experts, max(1, block_tokens) * top_k)



_HOST_STEP_OF_ARM = {"all": "all", "host": "host", "model": "split"}  # the guard's arms as host steps
GUARD_TRACE_STEPS = 64  # the guard's first steps kept for --json (arm, tokens, ms, how counted)
LINK_PROBE_EXPERTS = 8  # experts copied (twice) to time the link before the guard orders its arms

class RoutingRecord:
    """Experts each layer used, per forward, while recording (``OffloadedModel.record_routing``)."""

    def __init__(self):
        self.forwards: list[dict[int, list[int]]] = []

    def _start(self) -> None:
        self.forwards.append({})

    def _add(self, layer: int, experts: list[int]) -> None:
        if not self.forwards:
            self._start()
        self.forwards[-1][layer] = list(experts)

    def union(self) -> dict[int, set[int]]:
        """{layer: experts used by any recorded forward}."""
        out: dict[int, set[int]] = {}
        for fwd in self.forwards:
            for layer, ex in fwd.items():
                out.setdefault(layer, set()).update(ex)
        return out


class OffloadedModel:
    """See the module docstring. Build with :meth:`load`."""

    def __init__(self):
        raise TypeError("use OffloadedModel.load(model_dir, ...)")

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        expert_cache_mib: float | None = None,
        expert_cache_experts: int | None = None,
        block_tokens: int = 1,
        eviction: str = DEFAULT_EVICTION,
        link_gbps: float | None = None,
        workers: int = 2,
        chunk_mib: float = 4.0,
        lookahead_depth: int = 0,
        history_depth: int = 0,
        route_ahead_priority: int = Band.ROUTE_AHEAD,
        background_priority: int = Band.BACKGROUND,
        preload: bool = False,
        progress: bool = False,
        trace: int = 0,
        cpu_experts: str = "off",
        cpu_threads: int | None = None,
        hybrid_guard: bool = True,
    ) -> "OffloadedModel":
        """Validate and load a checkpoint; experts go to (pinned) host memory, the rest to ``device``.

        ``model_dir``: a checkpoint directory, or an open checkpoint object such as an in-memory
        ``synthetic.SyntheticCheckpoint`` (left open: its owner closes it after the model).

        Cache size: ``expert_cache_experts`` slots, else as many as fit in ``expert_cache_mib``,
        else every expert (all resident). Fewer than min(E, block_tokens * top_k) is an error.
        ``link_gbps`` (GB/s): on the CPU, simulates a host->device link of that speed (memcpy
        backend); on CUDA, paces the real copies to that rate (cuda backend: a copy is reported
        landed no earlier than the link would have carried it), so a fast link emulates a slower
        one, e.g. 25 for a desktop's PCIe 4.0 x16. ``stats()["link_emulated"]`` is True then.
        ``preload`` copies every expert that fits before returning (statistics start at zero).
        ``trace`` > 0 keeps that many ended transfers for ``rt.scheduler.drain_trace()``.

        ``cpu_experts``: "off" (every expert through the cache), "all" (every routed expert
        computed on the CPU by the native kernel from host memory; nothing is fetched, the
        cache keeps its minimum size and ``preload`` copies nothing) or "auto" (on CUDA, and
        on the CPU device with a simulated link, the per-layer placement decision of
        offload/cost.py: each non-resident expert fetched or computed on the CPU so that the
        layer ends soonest, hot CPU experts still cached in the background band; "all" on the
        CPU device otherwise). "auto" falls back to "off" where the kernel cannot read the experts (the
        reason is in ``stats()["cpu_experts"]``); "all" is an error there.
        ``cpu_threads``: the kernel's threads (default: the cores this process may use).
        ``hybrid_guard`` (with "auto"): decode steps check placements against what they realize,
        in turn fetch-only, every routed expert on the CPU, the cost model's split and every miss
        on the CPU, and keep the fastest
        (offload/cpu_compute.py, ``HybridGuard``); False trusts the per-layer cost model alone.
        """
        self = object.__new__(cls)
        self._closed = True
        self.scheduler = None
        self.host = None
        self.cache = None
        self.cpu = None
        self.slot_cpu = None
        dev = resolve_device(device)
        if eviction not in EVICTION_POLICIES:
            raise PdflashError(f"unknown eviction policy {eviction!r}: choose one of {', '.join(EVICTION_POLICIES)}",
                               exit_code=2)
        if link_gbps is not None and not (math.isfinite(link_gbps) and LINK_GBPS_MIN <= link_gbps <= LINK_GBPS_MAX):
            raise PdflashError(f"--link-gbps must be between {LINK_GBPS_MIN:g} and {LINK_GBPS_MAX:g} (GB/s), got {link_gbps:g}",
                               exit_code=2)
        if block_tokens < 1:
            raise PdflashError(f"block_tokens must be at least 1, got {block_tokens}")
        owned = isinstance(model_dir, (str, Path))  # else an open checkpoint object (synthetic.SyntheticCheckpoint)
        ckpt = Checkpoint(model_dir) if owned else model_dir
        try:
            self._load(ckpt, dev, dtype, expert_cache_mib, expert_cache_experts, block_tokens, eviction, link_gbps,
                       workers, chunk_mib, lookahead_depth, history_depth, route_ahead_priority, background_priority, progress,
                       trace, resolve_mode(cpu_experts), cpu_threads, hybrid_guard)
        except BaseException:
            self._release()
            raise
        finally:
            if owned:
                ckpt.close()
        if preload:
            self.preload()
        return self

    def _load(self, ckpt, dev, dtype, cache_mib, cache_experts, block_tokens, eviction, link_gbps, workers, chunk_mib,
              lookahead_depth, history_depth, route_ahead_priority, background_priority, progress, trace=0,
              cpu_mode="off", cpu_threads=None, hybrid_guard=True) -> None:
        fam = ckpt.family
        self._background_priority = background_priority
        self.path = ckpt.path
        self.family = fam
        self.device = dev
        self.dtype = resolve_dtype(dtype, ckpt.stored_dtype)
        L, E, K = fam.num_layers, fam.num_experts, fam.top_k

        # expert layout from the stored dtypes (every layer and expert must agree)
        stored = {piece: ckpt.dtype(src.first_name()) for piece, src in fam.expert_sources(0).items()}
        for layer in range(L):
            for piece, src in fam.expert_sources(layer).items():
                for name in src.names():
                    if ckpt.dtype(name) != stored[piece]:
                        raise PdflashError(f"{ckpt.path}: {name} is {ckpt.dtype(name)} but layer 0 stores {piece} as {stored[piece]}")
        layout = fam.expert_layout(stored)

        reason = fam.cpu_unsupported_reason(layout, self.dtype)
        asked = cpu_mode
        if cpu_mode == "auto":  # CPU device: all, unless a simulated link makes the placement meaningful
            cpu_mode = "all" if dev.type == "cpu" and link_gbps is None else "auto"
            if reason is not None:
                cpu_mode = "off"
        elif cpu_mode == "all" and reason is not None:
            raise PdflashError(f"--cpu-experts all: {reason}")
        if cpu_mode == "all" and (lookahead_depth or history_depth):
            if asked == "all":
                raise PdflashError("--cpu-experts all fetches nothing: drop --lookahead-depth / --history-depth")
            raise PdflashError("on the CPU device every expert is computed from host memory (--cpu-experts auto), so "
                               "nothing is fetched to prefetch: drop --lookahead-depth / --history-depth, or give "
                               "--link-gbps or --cpu-experts off to fetch experts into the cache")
        self.cpu_mode = cpu_mode
        self.cpu_reason = reason if cpu_mode == "off" else None

        n_slots = _slot_count(cache_mib, cache_experts, layout.expert_bytes, L * E)
        need = min_cache_experts(E, K, block_tokens)
        if cpu_mode == "auto" and n_slots >= L * E:  # every expert fits: no miss to place
            cpu_mode, self.cpu_mode = "off", "off"
            self.cpu_reason = "every expert fits in the expert cache: no miss to place"
        if cpu_mode == "all":
            n_slots = need  # never used: every expert is computed from host memory
        if n_slots < need:
            asked = f"{cache_mib:g} MiB" if cache_experts is None else f"{cache_experts} experts"
            raise PdflashError(
                f"an expert cache of {asked} holds {n_slots} experts of {_size(layout.expert_bytes)}; the minimum is {need} "
                f"({_size(need * layout.expert_bytes)}), what one layer may need at once (top-{K} x {block_tokens} token(s))"
            )

        self.host = HostStore(layout, L, E, pin=dev.type == "cuda")
        _fill_host(self.host, ckpt, fam, progress)
        try:
            self.scheduler = Scheduler(
                backend="cuda" if dev.type == "cuda" else "memcpy",
                workers=workers,
                link_gbps=link_gbps,
                chunk_bytes=max(4096, int(chunk_mib * 2**20)),
                device=dev.index or 0,
                trace=trace,
            )
        except SchedulerError as exc:
            raise PdflashError(f"could not start the fetch scheduler: {exc}") from None
        self.cache = ExpertCache(self.host, self.scheduler, dev, n_slots, policy=eviction)
        self.placer = None
        self.link_probe_bps = None  # _probe_link's rate (bytes/s), where the guard's order was timed
        self.guard_order = None  # the guard's arm order and its inputs (_start_cpu)
        self.link_gbps = link_gbps
        self.link_emulated = link_gbps is not None and dev.type == "cuda"  # real copies paced to link_gbps
        self.block_tokens = block_tokens
        self._observers: list[Callable[[int, list[int]], None]] = []
        self._forward_observers: list[Callable[[int], None]] = []
        self._records: list[RoutingRecord] = []
        self.last_routing: dict[int, list[int]] = {}

        kernel = None

        exchange = None  # one for every layer (HostExchange: one layer at a time)

        def make_experts(i: int, old) -> OffloadedExperts:
            nonlocal kernel, exchange
            if kernel is None:
                kernel = fam.expert_kernel(layout, self.dtype, old)
                if cpu_mode != "off":
                    self._start_cpu(cpu_mode, old, cpu_threads, hybrid_guard)
                if dev.type == "cpu" and cpu_mode != "all" and reason is None:
                    self._start_slot_cpu(old, cpu_threads)
                if self.cpu is not None and dev.type == "cuda":
                    exchange = HostExchange(dev)
            return OffloadedExperts(i, E, self.cache, kernel, self._on_routed, cpu=self.cpu, cpu_mode=self.cpu_mode,
                                    placer=self.placer, slot_cpu=self.slot_cpu, exchange=exchange,
                                    on_host_overhead=self._observe_host_overhead if self.placer is not None else None)

        self.model = fam.build(dev, self.dtype, ckpt.get, make_experts)
        self._cache_kwarg = fam.cache_kwarg(self.model)
        self.prefetcher = ExpertPrefetcher(
            self.cache, fam, self.model,
            route_ahead_priority=route_ahead_priority, background_priority=background_priority,
            lookahead_depth=lookahead_depth, history_depth=history_depth,
        )
        self.model.model.register_forward_pre_hook(self._on_forward_start, with_kwargs=True)
        for i, block in enumerate(fam.decoder_layers(self.model)):
            block.register_forward_pre_hook(self._layer_hook(i), with_kwargs=True)
        self._eos = _eos_ids(ckpt.path, ckpt.config)
        self._tokenizer = None
        self._closed = False

    def _start_cpu(self, cpu_mode: str, original, cpu_threads: int | None, hybrid_guard: bool = True) -> None:
        """The native CPU kernel over the host store (and, for "auto", the placement decision)."""
        from pdflash.native import NativeLibraryMissing
        from pdflash.native.cpu_experts import CpuExpertError

        fetching = None  # the default beside a GPU: fewer threads work while fetches may run
        if cpu_threads is None and self.device.type == "cuda":
            from pdflash.native.cpu_experts import default_threads

            cpu_threads, fetching = gpu_cpu_threads(default_threads(), self.scheduler.workers)
        try:
            self.cpu = self.family.cpu_runner(self.host, original, cpu_threads, self.dtype)
        except (CpuExpertError, NativeLibraryMissing) as exc:
            if cpu_mode == "auto":  # the default: fetch every miss, and say why
                self.cpu_mode, self.cpu_reason = "off", f"the CPU expert kernel cannot run here: {exc}"
                return
            raise PdflashError(f"--cpu-experts {cpu_mode}: {exc}") from None
        if fetching is not None and hasattr(self.cpu, "share_with_fetches"):
            self.cpu.share_with_fetches(fetching)
        if cpu_mode == "auto":
            from pdflash.offload.cpu_compute import CpuPlacement, HybridGuard, guard_order

            self.cpu.calibrate()
            if self.device.type == "cuda" and self.link_gbps is None:
                self.link_probe_bps = self._probe_link()
            host_s, fetch_s, host_steps = self.cpu.seconds_for(1), self.cost.seconds_per_expert_fetch(), self._host_steps_likely()
            segmented = self.device.type == "cuda" and not host_steps
            order = guard_order(host_s, fetch_s, host_steps, segmented)
            self.guard_order = {"order": list(order), "host_expert_ms": host_s * 1e3 if host_s else None,
                                "fetch_expert_ms": fetch_s * 1e3, "host_steps": host_steps, "segmented": segmented}
            guard = HybridGuard(arms=order, trace=GUARD_TRACE_STEPS) if hybrid_guard else None
            self.placer = CpuPlacement(self.cache, self.scheduler, self.cpu, self.cost,
                                       background_band=self._background_priority, guard=guard)
            if guard is not None:
                self.add_forward_observer(guard.on_forward)

    def _probe_link(self, experts: int = LINK_PROBE_EXPERTS) -> float | None:
        """Time the link as :meth:`CpuRunner.calibrate` times the kernel, for the guard's order:
        copy ``experts`` of layer 0's experts into the cache through the scheduler twice (the first
        round pays the copies' start-up), feed the second round's rate to the cost model (its
        prior until then: 25 GB/s on CUDA), and empty the cache and the statistics again. Returns
        the rate measured (bytes/s), or None."""
        n = min(experts, self.cache.capacity, self.family.num_experts)
        keys = [(0, e) for e in range(n)]
        rate = None
        for measured in (False, True):
            self.cache.reset()  # an empty cache (every key copies) and the scheduler's counters at zero
            self.cost.observe_scheduler(self.scheduler.stats())  # the interval starts here
            if self.cache.fill(keys) == n and measured:
                rate = self.cost.observe_scheduler(self.scheduler.stats())
        self.cache.reset()
        return rate

    def _host_handoff(self) -> str | None:
        """How host steps hand their layers to the CPU (host_graph.py): "flags" (the relay),
        "node" (host nodes), "direct" (the CPU device: a direct call); None before any host step."""
        steps = self.__dict__.get("_host_steps")
        if steps is None:
            return None
        if steps.launch is None:
            return "direct"
        return "flags" if steps.relay is not None else "node"

    def _host_steps_likely(self) -> bool:
        """Whether a graphed decoder will run the guard's host arm as host steps (mode "host":
        CUDA, a runner whose layers run as host steps (gpt-oss's), the fused MXFP4 kernel, host
        steps not turned off by PDFLASH_HOST_STEPS=0)."""
        from pdflash.offload import mxfp4_triton
        from pdflash.offload.host_graph import host_steps_enabled

        if self.device.type != "cuda" or not host_steps_enabled() or not getattr(self.cpu, "host_steps", False):
            return False

        return bool(self.host.layout.quantized) and mxfp4_triton.available(self.device)

    def _start_slot_cpu(self, original, cpu_threads: int | None) -> None:
        """CPU device, experts through the cache: the native kernel computes them from their slot
        rows (host memory here) instead of torch dequantizing every use; the host-path runner
        when there is one. Not where the kernel cannot run (no native library, a family without
        ``native_cpu_experts``) or with PDFLASH_FUSED_EXPERTS=0 (the generic path, as on CUDA)."""
        from pdflash.native import NativeLibraryMissing
        from pdflash.native.cpu_experts import CpuExpertError

        if os.environ.get("PDFLASH_FUSED_EXPERTS") == "0" or not self.family.native_cpu_experts:
            return
        from pdflash.offload.cpu_compute import CpuExpertRunner

        runner = self.cpu
        if runner is None:
            try:
                runner = self.family.cpu_runner(self.host, original, cpu_threads, self.dtype)
            except (CpuExpertError, NativeLibraryMissing):
                return
        if not isinstance(runner, CpuExpertRunner):  # a family's PyTorch fallback (offload/torch_cpu.py)
            if runner is not self.cpu:
                runner.close()
            return
        self.slot_cpu = runner

    # -- hooks -----------------------------------------------------------------------
    def _on_forward_start(self, module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = args[0] if args else None
        if x is not None:
            tokens = x.numel()
        else:
            emb = kwargs.get("inputs_embeds")
            tokens = emb.shape[:-1].numel() if emb is not None else 0
        self.begin_forward(tokens)

    def begin_forward(self, tokens: int) -> None:
        """A forward over ``tokens`` tokens starts (the model's hook calls this; so does graphs.py,
        whose replayed segments run no hooks)."""
        self.cache.begin_forward(tokens)
        for rec in self._records:
            rec._start()
        for fn in self._forward_observers:
            fn(tokens)

    def all_on_cpu(self, tokens: int) -> bool:
        """A forward of ``tokens`` tokens computes every routed expert on the CPU (--cpu-experts
        all, or auto's guard on its "all" arm): the experts modules' own rule (experts.py ``_arm``)."""
        return self.host_placement(tokens) == "all"

    def host_placement(self, tokens: int) -> str | None:
        """How a forward of ``tokens`` tokens places experts where a host step (host_graph.py) can
        serve it: "all" (every routed expert on the CPU), "host" (the guard's host arm: the cache's
        hits on the device, every other expert on the CPU), "split" (the guard's model arm: the
        cost model splits each layer's misses between the link and the CPU), or None (fetch-only,
        or no guard)."""
        if self.cpu is None:
            return None
        if self.cpu_mode == "all":
            return "all"
        if self.cpu_mode == "auto" and self.placer is not None:
            arm = self.placer.arm(tokens)
            guard = self.placer.guard
            if arm == "model" and guard is not None and tokens > guard.max_tokens:
                return None  # a prefill the guard does not judge: the experts module's per-layer split
            return _HOST_STEP_OF_ARM.get(arm)
        return None

    def host_placements(self, tokens: int) -> list[str | None]:
        """Every :meth:`host_placement` a forward of ``tokens`` tokens may take from now on: the
        current one, or, while auto's guard still tries arms, each of its arms' (graphs.py
        captures a graph for each before a sequence starts)."""
        guard = self.placer.guard if self.cpu_mode == "auto" and self.placer is not None else None
        if self.cpu is None or guard is None or guard.pinned or guard.short or tokens > guard.max_tokens:
            return [self.host_placement(tokens)]
        return list(dict.fromkeys(_HOST_STEP_OF_ARM.get(a) for a in guard.arms))

    def _layer_hook(self, i: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.prefetcher.on_layer_start(i, hidden)

        return hook

    def _on_routed(self, layer: int, experts: list[int]) -> None:
        self.last_routing[layer] = experts
        for rec in self._records:
            rec._add(layer, experts)
        self.prefetcher.on_layer_routed(layer, experts)
        for fn in self._observers:
            fn(layer, experts)

    def add_forward_observer(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(tokens)`` as every target forward starts, eager or graphed (graphs.py's
        replayed segments run no module hooks, but they start through :meth:`begin_forward`)."""
        self._forward_observers.append(fn)

    def remove_forward_observer(self, fn: Callable[[int], None]) -> None:
        if fn in self._forward_observers:
            self._forward_observers.remove(fn)

    def add_routing_observer(self, fn: Callable[[int, list[int]], None]) -> None:
        """Call fn(layer, experts) each time a layer's forward has routed (experts sorted)."""
        self._observers.append(fn)

    def remove_routing_observer(self, fn: Callable[[int, list[int]], None]) -> None:
        self._observers.remove(fn)

    @contextlib.contextmanager
    def record_routing(self) -> Iterator[RoutingRecord]:
        """Record which experts each layer used in each forward inside the block."""
        rec = RoutingRecord()
        self._records.append(rec)
        try:
            yield rec
        finally:
            self._records.remove(rec)

    # -- use -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise PdflashError("this OffloadedModel is closed; load the model again")

    def set_batch_invariant(self, on: bool) -> None:
        """Whether the CPU experts' calls are batch invariant from now on (CpuRunner.set_invariant):
        a batch-invariant verify decoder's steps ask for it (offload/graphs.py, fixed rows), so that a
        position's experts compute alike in any verify block; its prefill and every other decoder's
        forwards ask for the kernel's fastest choice."""
        for runner in (self.cpu, self.slot_cpu if self.slot_cpu is not self.cpu else None):
            if runner is not None:
                runner.set_invariant(on)

    def begin_sequence(self, steps: int | None = None) -> None:
        """A new sequence starts (its prompt comes next), of at most ``steps`` decode steps (None:
        unknown): the time since the last forward holds whatever ran between two sequences and is
        no decode step, and a short sequence may run the guard's first arm unchecked (the hybrid
        guard, ``HybridGuard.on_sequence``)."""
        if self.placer is not None and self.placer.guard is not None:
            self.placer.guard.on_sequence(steps)

    def new_kv_cache(self):
        """An empty KV cache for ``forward`` (transformers DynamicCache, sliding layers as the
        model's config says); a new sequence starts (:meth:`begin_sequence`)."""
        from transformers import DynamicCache

        self.begin_sequence()

        return DynamicCache(config=self.model.config)

    def decode_threads(self):
        """Context for a decode loop: PyTorch's intra-op threads as offload/threads.py picks them
        for this model (one for a small model on the CPU device)."""
        from pdflash.offload.threads import decode_threads, intra_op_threads

        return intra_op_threads(decode_threads(self.device, self.family.hidden))

    def forward(self, input_ids: torch.Tensor, cache=None, **kwargs):
        """``model(input_ids, <kv cache>=cache, use_cache=True, **kwargs)`` without autograd."""
        self._check_open()
        kwargs[self._cache_kwarg] = cache
        kwargs.setdefault("use_cache", cache is not None)
        with torch.inference_mode():
            return self.model(input_ids=input_ids.to(self.device), **kwargs)

    def preload(self, zero_stats: bool = True) -> int:
        """Copy experts into the cache, layer by layer, until it is full; returns how many landed.

        With ``zero_stats`` the scheduler's and the cache's statistics start from zero afterwards.
        """
        self._check_open()
        if self.cpu_mode == "all":  # nothing is ever read from the cache
            return 0
        keys = [(layer, e) for layer in range(self.family.num_layers) for e in range(self.family.num_experts)]
        n = self.cache.fill(keys[: self.cache.capacity])
        if zero_stats:
            self.scheduler.reset()  # nothing is queued now: this only zeroes its statistics
            self.cache.zero_stats()
        return n

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer (transformers AutoTokenizer), loaded on first use."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    @property
    def cost(self):
        """The runtime's one cost model (offload/cost.py), made on first use: speculation's block
        planner and hybrid execution read and feed the same measured rates. It outlives
        reset_cache(): the rates describe the machine, not a run."""
        if getattr(self, "_cost", None) is None:
            from pdflash.offload.cost import CostModel

            self._cost = CostModel.for_runtime(self)
        return self._cost

    def forget_costs(self) -> None:
        """Drop the cost model's measurements (the next use starts from its priors, as a fresh
        process does). Hybrid execution's calibrated host rate stays installed."""
        old = getattr(self, "_cost", None)
        self._cost = None
        if old is not None and old.cpu_expert_seconds is not None:
            self.cost.set_cpu_expert_rate(old.cpu_expert_seconds, placement=old.placement)
        if self.placer is not None:
            self.placer.cost = self.cost

    def _observe_host_overhead(self, seconds: float) -> None:
        self.cost.observe_host_overhead(seconds)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    @property
    def config(self):
        return self.model.config

    # -- measurements ----------------------------------------------------------------
    def stats(self) -> dict:
        """Plain-dict measurements since load or the last reset_cache(). Unmeasured values are None."""
        self._check_open()
        fs = self.cache.stats
        st = self.scheduler.stats()
        ran = fs.forwards > 0
        bands = []
        for b in Band:
            lv = st["levels"][b]
            bands.append({
                "band": int(b), "name": band_name(b),
                "submitted": lv["submitted"], "completed": lv["completed"], "cancelled": lv["cancelled"],
                "promoted": lv["promoted"], "deduplicated": lv["deduplicated"],
                "queue_depth": lv["queue_depth"], "in_flight": lv["in_flight"],
                "stall_seconds": lv["stall_s"], "queue_wait_seconds": lv["queue_wait_s"],
                "max_queue_wait_seconds": lv["max_queue_wait_s"], "bytes": lv["bytes"],
            })
        bytes_moved = sum(lv["bytes"] for lv in st["levels"])
        hits, misses = fs.hits, fs.misses
        promoted = sum(lc.promoted for lc in fs.layers)
        exposed_by_band = {band_name(b): fs.exposed_by_band.get(int(b), 0.0) for b in Band} if ran else None
        for b, s in fs.exposed_by_band.items():
            if exposed_by_band is not None and b > Band.BACKGROUND:
                exposed_by_band[band_name(b)] = s
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "family": self.family.model_type,
            "expert_format": self.family.expert_format,
            "expert_bytes": self.host.layout.expert_bytes,
            "forwards": fs.forwards,
            "tokens": fs.tokens,
            "exposed_fetch_seconds": fs.exposed_s if ran else None,
            "exposed_fetch_by_band": exposed_by_band,
            "waits_by_band": {band_name(b): n for b, n in sorted(fs.waits_by_band.items())} if ran else None,
            "cache": {
                "slots": self.cache.capacity,
                "slot_bytes": self.cache.slot_bytes,
                "policy": self.cache.policy,
                **self.cache.occupancy(),
                "hits": hits,
                "misses": misses,
                "promoted": promoted,
                "hit_rate": fs.hit_rate(),
                "evictions": fs.evictions,
            },
            "prefetch": {
                "issued": {band_name(b): n for b, n in sorted(fs.prefetch_issued.items())},
                "used": fs.prefetch_used,
                "wasted": fs.prefetch_wasted,
                "cancelled": fs.prefetch_cancelled,
                "dropped": fs.prefetch_dropped,
                "redundant": fs.prefetch_redundant,
                "accuracy": self.prefetcher.accuracy(),
                **self.prefetcher.settings(),
            },
            "demand_fetches": fs.demand_fetches,
            "cpu_experts": {
                "mode": self.cpu_mode,
                "reason_off": self.cpu_reason,
                "computed": fs.cpu,
                "seconds": fs.cpu_seconds if ran else None,
                "host_steps": fs.host_steps,
                "host_table_syncs": fs.host_table_syncs,
                "host_handoff": self._host_handoff(),
                "host_timeline_ms": fs.host_timeline_ms(),
                # split host steps: the next layer's predicted experts prefetched at band 1 into its stages
                "route_ahead": {"sent": fs.route_ahead_sent, "used": fs.route_ahead_used,
                                "cancelled": fs.route_ahead_cancelled,
                                "precision": fs.route_ahead_used / fs.route_ahead_sent if fs.route_ahead_sent else None},
                "guard": self.placer.guard.stats() if self.placer is not None and self.placer.guard is not None else None,
                "link_probe_gbps": self.link_probe_bps / 1e9 if self.link_probe_bps else None,  # timed at load
                "guard_order": self.guard_order,  # the arms' order and what set it (cpu_compute.guard_order)
                "cache_experts_native": self.slot_cpu is not None,
                **(self.cpu.stats() if self.cpu is not None else {}),
            },
            "experts_per_token": {
                "cache": hits / fs.tokens if fs.tokens else None,
                "fetched": misses / fs.tokens if fs.tokens else None,
                "cpu": fs.cpu / fs.tokens if fs.tokens else None,
            },
            "bytes_moved": bytes_moved,
            "bytes_per_token": bytes_moved / fs.tokens if fs.tokens else None,
            "link_busy_seconds": st["link_busy_s"],
            "elapsed_seconds": st["elapsed_s"],
            "link_gbps": self.link_gbps,
            "link_emulated": self.link_emulated,
            "bands": bands,
            "per_layer": [
                {"layer": i, "hits": lc.hits, "misses": lc.misses, "promoted": lc.promoted, "cpu": lc.cpu,
                 "exposed_fetch_seconds": lc.exposed_s if ran else None, "waits": lc.waits}
                for i, lc in enumerate(fs.layers)
            ],
            "errors": list(self.cache.errors),
        }

    def resident_experts(self) -> dict[int, list[int]]:
        """{layer: experts resident in the device cache now}."""
        self._check_open()
        return self.cache.resident()

    def hit_rate(self) -> float | None:
        return self.cache.stats.hit_rate()

    # -- lifecycle -------------------------------------------------------------------
    def reset_cache(self, capacity_experts: int | None = None) -> None:
        """Not terminal: empty the device cache and the scheduler's queues, zero all statistics.

        ``capacity_experts`` limits the cache to that many of its allocated slots from now on
        (at least the load-time minimum, at most the slots allocated); None keeps the limit.
        """
        self._check_open()
        if capacity_experts is not None:
            fam = self.family
            need = min_cache_experts(fam.num_experts, fam.top_k, self.block_tokens)
            if not need <= capacity_experts <= self.cache.n_slots:
                raise PdflashError(f"capacity_experts must be between {need} (one layer of a {self.block_tokens}-token "
                                   f"block) and the {self.cache.n_slots} slots allocated at load, got {capacity_experts}")
        self.cache.reset(capacity_experts)
        steps = self.__dict__.get("_host_steps")
        if steps is not None:
            steps.invalidate_plans()
        if self.cpu is not None:
            self.cpu.reset_stats()
        self.prefetcher.reset()
        self.last_routing = {}

    def close(self) -> None:
        """Terminal and idempotent: stop the scheduler, release pinned host and device memory."""
        if getattr(self, "_closed", True) and self.scheduler is None and self.cpu is None:
            return
        self._release()

    def _release(self) -> None:
        self._closed = True
        steps = self.__dict__.pop("_host_steps", None)
        if steps is not None:  # before the CPU kernel: its graphs' host nodes use the kernel's pool
            steps.close()
        if self.scheduler is not None:
            self.scheduler.close()  # joins workers; no copy touches the buffers after this
            self.scheduler = None
        if self.slot_cpu is not None and self.slot_cpu is not self.cpu:
            self.slot_cpu.close()
        self.slot_cpu = None
        if self.cpu is not None:
            self.cpu.close()
            self.cpu = None
        if self.cache is not None:
            self.cache.close()
        if self.host is not None:
            self.host.close()
        self.model = None
        self.prefetcher = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> "OffloadedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _slot_count(cache_mib: float | None, cache_experts: int | None, expert_bytes: int, total: int) -> int:
    if cache_mib is not None and cache_experts is not None:
        raise PdflashError("give the expert cache size in MiB or as a count of experts, not both", exit_code=2)
    if cache_experts is not None:
        if cache_experts < 0:
            raise PdflashError(f"the expert cache size must be 0 or more, got {cache_experts} experts", exit_code=2)
        return min(int(cache_experts), total)
    if cache_mib is not None:
        if not math.isfinite(cache_mib) or cache_mib < 0:
            raise PdflashError(f"--expert-cache-mib must be a finite number, 0 or more, got {cache_mib}", exit_code=2)
        return min(int(cache_mib * 2**20 // expert_bytes), total)
    return total


def _fill_host(host: HostStore, ckpt: Checkpoint, fam, progress: bool) -> None:
    layers = range(fam.num_layers)
    bar = None
    if progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("loading experts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=Console(stderr=True), transient=True)
        bar.start()
        task = bar.add_task("layers", total=fam.num_layers)
    get_many = getattr(ckpt, "get_many", None) or (lambda names: [ckpt.get(n) for n in names])
    try:
        for layer in layers:
            sources = fam.expert_sources(layer)
            names = [n for src in sources.values() for n in src.names()]
            got = dict(zip(names, get_many(names)))  # one layer at a time: memory holds one layer
            stacked = {piece: got[src.stacked] for piece, src in sources.items() if src.stacked is not None}
            if stacked:
                host.fill_layer(layer, stacked)
            for piece, src in sources.items():
                for e, expert_names in enumerate(src.per_expert):
                    parts = [got[n] for n in expert_names]
                    host.fill_piece(layer, e, piece, parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
            del got
            if bar is not None:
                bar.advance(task)
    finally:
        if bar is not None:
            bar.stop()


def _eos_ids(path: Path, config: dict) -> list[int]:
    ids = None
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            ids = json.loads(gen.read_text()).get("eos_token_id")
        except (ValueError, OSError):
            ids = None
    if ids is None:
        ids = config.get("eos_token_id")
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def gpu_cpu_threads(cores: int, workers: int) -> tuple[int, int]:
    """The CPU kernel's default thread counts beside a GPU: (its pool, the threads that work while
    fetches may run). The pool: every core but two (the decoding thread, which waits on the device,
    and the thread that runs host steps' layers: the relay's, or CUDA's callback thread). Beside
    fetches, one core fewer for each scheduler copy worker, never fewer than three quarters of the
    cores: with every core in the pool the copy workers wake late after each chunk and the link's
    rate halves (gpt-oss-20b shape, 16 cores, 2 workers: 16-18 GB/s with 16 threads, 30-32 GB/s
    with 12 or 14), while steps that fetch nothing (the host arm's host steps) ran 1.08x faster
    with 14 threads than with 12 on the gpt-oss-120b shape (docs/benchmarks.md)."""
    fetching = max(1, cores - workers - 2, cores * 3 // 4)
    return max(fetching, cores - 2), fetching


def load_tokenizer(path: str | Path):
    """transformers AutoTokenizer of a checkpoint directory, or a PdflashError saying what is missing."""
    p = Path(path)
    if not ((p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file()):
        raise PdflashError(f"{p}: no tokenizer files (tokenizer.json); the checkpoint cannot turn text into tokens")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p))
    except Exception as exc:
        raise PdflashError(f"{p}: the tokenizer could not be loaded ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
