"""OffloadedExperts: the per-layer module that replaces a model's experts module.

Called exactly like transformers' experts module: ``experts(hidden_states,
router_indices, routing_weights)`` with hidden [T, H], indices [T, K] and weights
[T, K] (or dense [T, E] scores, as transformers 4.x passed them). The routing is
given; this module

1. copies the router indices to the CPU (the one device->host sync per layer, see
   the CUDA ordering invariant in cache.py) and groups tokens by expert,
2. computes the experts already resident first,
3. fetches the misses through the cache (band 0, or promoting a prefetch already
   on the way), computing each batch of arrivals while later ones are still
   crossing the link,
4. sums each token's K weighted expert outputs in top-k order in one reduction.

Three compute paths, each independent of which experts were hits or how arrivals were
batched (so every cache size gives the same output):
- the fused Triton kernels (mxfp4_triton.py, dense_triton.py) for up to FUSED_MAX_TOKENS tokens
  on CUDA (decode, verify blocks): one program per (token, expert) pair and feature tile;
- on the CPU device, the native CPU kernel reading the slot rows in place (``slot_cpu``, where it
  reads the family's experts): one call per batch, each (token, expert) row computed alone;
- otherwise (prefill, the CPU, dense experts) one matmul per expert over its tokens in
  token order, mirroring the library's own per-expert loop (the family's kernel: weights and
  apply), so outputs are bit-identical to the library's CPU path.

CPU experts (``cpu``, a CpuExpertRunner over the host store): experts chosen by
``cpu_mode`` are computed by the native CPU kernel straight from host memory instead of
being fetched: "all" computes every routed expert there (the cache is not used); "auto"
asks ``placer`` (the cost model) which non-resident experts to compute on the CPU and which
to fetch, or, while its guard's arm is "all", takes the "all" path for the step. On CUDA a layer that may
compute on the CPU first wakes the kernel's thread pool (``cpu.prewake``), so its threads poll for the call
while the routing copy waits for the device; the routing, the routing weights and the hidden rows come to the
host in one copy (host_exchange.py); the misses are requested first, then this thread runs the CPU
experts (the kernel's pool, this thread its thread 0) while the link works, then launches the
resident experts with the first arrivals (one launch) and the later arrivals as they land; the
results join in the same reduction. CPU results are float32, scaled by the routing weight, written into a pinned
buffer that is zero where the device computes, copied up in one copy and added to the device's
rows (x + 0 = x: the same values as storing them row by row).

Shape legend: T tokens, K experts per token, H hidden, E experts per layer.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch
from torch import nn

from pdflash import PdflashError
from pdflash.offload.cache import ExpertCache
from pdflash.offload.mxfp4_triton import MAX_TOKENS as FUSED_MAX_TOKENS


class OffloadedExperts(nn.Module):
    """One layer's experts, resident in host memory, fetched into the device cache on use."""

    def __init__(
        self,
        layer: int,
        num_experts: int,
        cache: ExpertCache,
        kernel,
        on_routed: Callable[[int, list[int]], None],
        cpu=None,
        cpu_mode: str = "off",
        placer=None,
        slot_cpu=None,
        on_host_overhead: Callable[[float], None] | None = None,
        exchange=None,
    ):
        super().__init__()
        self.layer = layer
        self.num_experts = num_experts
        self.cache = cache
        self.kernel = kernel
        self.on_routed = on_routed
        self.cpu = cpu  # CpuExpertRunner or None
        self.cpu_mode = cpu_mode if cpu is not None else "off"
        self.placer = placer  # CpuPlacement: (layer, misses, positions, K, arm) -> experts for the CPU
        self.slot_cpu = slot_cpu  # CPU device: the native kernel over the cache's slot rows (CpuExpertRunner.run_slots)
        self.on_host_overhead = on_host_overhead  # the cost model's per-layer host overhead (hybrid)
        self.exchange = exchange  # HostExchange (CUDA with CPU experts): the routing down, the CPU's results up
        self.calls = 0

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, offloaded"

    def forward(self, hidden_states: torch.Tensor, router_indices=None, routing_weights=None) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        T, H = x.shape
        idx = router_indices.reshape(T, -1)  # [T, K]
        w = routing_weights.reshape(T, -1)
        if w.shape[1] != idx.shape[1]:  # dense scores [T, E]: keep the routed ones, in top-k order
            w = w.gather(1, idx)
        K = idx.shape[1]
        self.calls += 1
        cache, layer = self.cache, self.layer

        exchange = self.exchange if self.cpu is not None else None
        arm = self._arm(T)
        if exchange is not None and arm != "off":
            self.cpu.prewake()  # the pool wakes while the routing copy waits for the device
        if exchange is not None:  # one copy for the routing and the CPU's rows
            idx_cpu, w_host, x_host = exchange.routing(idx, w, x)
        else:
            idx_cpu = idx.to("cpu")  # device->host sync: every earlier kernel has finished (cache.py)
            x_host, w_host = x, w.reshape(-1)  # the CPU device: x and w are host tensors already
        cache.sync_point()
        positions: dict[int, list[int]] = {}  # expert -> its positions p = t*K + k, ascending
        for p, e in enumerate(idx_cpu.view(-1).tolist()):
            positions.setdefault(e, []).append(p)
        experts = sorted(positions)
        self.on_routed(layer, experts)

        dev = x.device
        w_flat = w.reshape(-1)
        out_dtype = torch.promote_types(self.kernel.dtype, w.dtype)

        if arm == "all":
            # every routed expert on the CPU, nothing fetched: every row is the CPU's
            buf = self._cpu_compute(x_host, w_host, K, experts, positions, exchange)[1]
            contrib = (exchange.upload(buf) if exchange is not None else buf).to(out_dtype)
            out = contrib.view(T, K, H).sum(dim=1).to(hidden_states.dtype)
            return out.reshape(shape)
        fused = self.kernel.fused(dev) if T <= FUSED_MAX_TOKENS else None
        if fused is not None:
            x = x.contiguous()
            w_flat = w_flat.contiguous()
            h = torch.empty((T * K, fused.inter), dtype=self.kernel.dtype, device=dev)
        native = fused is None and self.slot_cpu is not None and dev.type == "cpu"
        if native:
            x = x.contiguous()
            w32 = w_flat.to(torch.float32).contiguous()
            buf = torch.empty((T * K, H), dtype=torch.float32)

        def compute(batch: list[tuple[int, int]]) -> None:
            """batch: [(expert, slot)] -> writes contrib rows of their (t, k) positions."""
            if fused is not None:  # one program per (position, feature tile): batch-invariant
                pos = [p for e, _ in batch for p in positions[e]]
                slot_of = [s for e, s in batch for _ in positions[e]]
                work = torch.tensor([pos, slot_of], dtype=torch.int32).to(dev, non_blocking=True)
                fused.run(cache.slots, x, w_flat, work, h, contrib, K)
                return
            if native:  # the CPU device: slot rows are host memory, read in place by the native kernel
                self.slot_cpu.run_slots(cache.slots, batch, positions, K, x, w32, buf)
                self._store_cpu(contrib, ([p for e, _ in batch for p in positions[e]], buf), dev)
                return
            weights = self.kernel.weights(cache.slots, [s for _, s in batch])
            for i, (e, _) in enumerate(batch):  # one matmul per expert: its result depends only on its tokens
                pos = torch.tensor(positions[e]).to(dev, non_blocking=True)
                y = self.kernel.apply(weights, i, x.index_select(0, pos // K))
                contrib.index_copy_(0, pos, y * w_flat[pos].unsqueeze(-1))

        hits, misses, pending, waiting = [], [], deque(), deque()
        for e in experts:
            s = cache.lookup(layer, e)
            (hits.append((e, s)) if s is not None else misses.append(e))
        cpu_result, cpu_list = None, []
        if self.cpu_mode == "auto" and misses and self.placer is not None:  # asked under "off" too: it observes the link
            on_cpu = set(self.placer(layer, misses, positions, K, arm))
            if on_cpu:
                misses = [e for e in misses if e not in on_cpu]
                cpu_list = sorted(on_cpu)
        # weighted output per (t, k); with CPU experts on CUDA, zero where the device writes
        # nothing: the CPU's rows arrive as a zero-filled buffer added to it
        joined = exchange is not None and cpu_list
        contrib = (torch.zeros if joined else torch.empty)((T * K, H), dtype=out_dtype, device=dev)
        for e in misses:  # submitted before anything is computed, so the link starts at once
            f = cache.request(layer, e)
            (pending.append((e, f)) if f is not None else waiting.append(e))
        done_slots = []
        # With CPU experts the hits join the first arrivals in one launch after the CPU call (on
        # CUDA the device would finish them long before the CPU anyway, and each launch costs host
        # time: a profile of the split put 1.9 launches per layer at a quarter of its host work);
        # not with waves, where the slots the hits hold may be needed before they are computed.
        deferred = hits if cpu_list and not waiting else []
        if hits and not deferred:  # on CUDA only launched: the device computes them while the CPU computes below
            compute(hits)
            done_slots += [s for _, s in hits]
        if cpu_list:  # on this thread, while the fetches cross the link (and the device computes the hits)
            cpu_result = self._cpu_compute(x_host, w_host, K, cpu_list, positions, exchange)
            if self.on_host_overhead is not None and dev.type == "cuda":  # its time beyond the kernel's
                self.on_host_overhead(cpu_result[2] - cpu_result[3])
        if deferred and not pending:
            compute(deferred)
            deferred = []
        while pending or waiting:
            if pending:
                e, f = pending.popleft()
                batch, deferred = deferred + [(e, cache.wait(f))], []
                while pending and cache.ready(pending[0][1]):
                    e2, f2 = pending.popleft()
                    batch.append((e2, cache.wait(f2)))
                compute(batch)
                done_slots += [s for _, s in batch]
            while waiting:  # more distinct experts than free slots: reuse computed ones (waves)
                f = cache.request(layer, waiting[0])
                if f is None:
                    if pending:
                        break
                    if dev.type == "cuda":
                        torch.cuda.current_stream(dev).synchronize()  # their kernels must finish first
                    cache.release(done_slots)
                    done_slots = []
                    f = cache.request(layer, waiting[0])
                    if f is None:
                        raise PdflashError(f"layer {layer}: no expert cache slot could be freed")
                pending.append((waiting.popleft(), f))
        if cpu_result is not None:
            if joined:
                contrib.add_(exchange.upload(cpu_result[1]))
            else:
                self._store_cpu(contrib, cpu_result, dev)
        cache.end_layer()
        out = contrib.view(T, K, H).sum(dim=1).to(hidden_states.dtype)  # [T, H]
        return out.reshape(shape)

    def _arm(self, T: int) -> str:
        """This forward's placement of the experts it misses: "off" (fetch them all), "all"
        (every routed expert on the CPU, resident ones too), or the placer's arm for ``T``
        tokens ("model", "host"; see CpuPlacement)."""
        if self.cpu_mode == "all":
            return "all"
        if self.cpu_mode == "auto" and self.placer is not None:
            return self.placer.arm(T)
        return "off"

    def _cpu_compute(self, x: torch.Tensor, w_flat: torch.Tensor, K: int, experts: list[int],
                     positions: dict[int, list[int]], exchange) -> tuple[list[int], torch.Tensor, float, float]:
        """The native kernel on the host for ``experts``, in one call: (positions, a float32
        [T*K, H] buffer holding their weighted outputs at those rows, the call's wall seconds,
        the kernel's own seconds). x and w_flat are host tensors (on CUDA the copies of the
        exchange, whose pinned result buffer then holds the outputs, zero in the other rows)."""
        t0 = time.perf_counter()
        T, H = x.shape
        if exchange is not None:
            buf = exchange.result_buffer(T * K, H, zero=len(experts) < len(positions))
        else:
            buf = torch.empty((T * K, H), dtype=torch.float32)
        k0 = self.cpu.seconds
        self.cpu.run_layer(self.layer, experts, positions, K, x, w_flat, buf)
        kernel = self.cpu.seconds - k0
        self.cache.stats.layers[self.layer].cpu += len(experts)
        wall = time.perf_counter() - t0
        self.cache.stats.cpu_seconds += wall
        return [p for e in experts for p in positions[e]], buf, wall, kernel

    @staticmethod
    def _store_cpu(contrib: torch.Tensor, results: tuple, dev: torch.device) -> None:
        """Rows of the CPU's results into contrib (the CPU device: both are host tensors)."""
        p = torch.tensor(results[0])
        contrib.index_copy_(0, p, results[1].index_select(0, p).to(dev, contrib.dtype))
