"""Host steps: a decode step whose every routed expert runs on the CPU, captured as one CUDA graph.

With every routed expert on the CPU (``--cpu-experts all``, or auto's guard on its "all" arm) the
device runs only attention, norms, routers and the head. Driven from Python (graphs.py's
segments, the experts module between them) each layer also pays host work beside the kernel: the
routing copy's synchronisation, the kernel's argument lists, the result copy, the sum, the next
segment's launch (docs/benchmarks.md: about 0.45 ms in session 6; host steps saved 83-129 us per
layer on an H100 machine in session 23). A host step captures
the whole step as one graph instead; each layer's experts are, inside it,

    pack   one kernel: expert indices (int64), routing weights (float32) and token rows, as int16
           words, into one device buffer (HostExchange's layout)
    down   one copy into the layer's page-locked host buffer
    host   a host node (cudaLaunchHostFunc, captured): pf_layer_run (native/pf_layer.c) groups the
           positions by expert, runs the native kernel once (pool woken at the previous layer's
           end), writes float32 weighted rows into the shared page-locked up buffer
    up     one copy to the device, then the sum over top-k and the residual add (on CUDA one
           kernel, moe_residual: the device's rows, the CPU's, the sum, the cast and the add)

so a step costs one graph launch and one synchronisation, and no Python between layers.

The hand-off (``PDFLASH_HOST_HANDOFF``): by default a layer's host node is not a host node but a
pair of stream memory operations, captured like the rest: the device writes the layer's down flag
once the routing has landed and waits for its up flag; a relay thread (``native/pf_relay.c``),
armed with the step's layers before the replay, runs each layer when its flag comes and sets the
up flag. A host node's round trip through the driver's callback thread cost 40-55 us a layer on
an H100 machine, the flags and the relay about 6 (``benchmarks/handoff_gpu.py``). ``node``: host nodes
(``cudaLaunchHostFunc``), also where the driver has no stream memory operations. A capture's
eager warm-up always runs its layers as host functions.

Mode "host" (the hybrid guard's host arm: the cache's hits on the device, every other expert on the
CPU, nothing fetched) adds the hits: each position's slot from a device table
of the cache's resident experts (-1: not resident), the fused MXFP4 kernel over every position
(a non-resident one reads no weights and gives a zero row; each pair's result is its own, so the
hits' rows are the experts module's), while the host node skips the resident experts (a
host-side resident map, ``pf_layer``'s); the device adds the CPU's rows to its own. On CUDA the
hits' kernel runs on a side stream forked before the pack and joined after the host node, so the
device computes them while the host node runs (``PDFLASH_HOST_SIDE_STREAM=0``: before the pack,
on the step's stream). The table and
the map are refreshed before a step whenever the cache's resident set changed (``ExpertCache.version``);
nothing changes the cache while a step runs (a step's own fetches, mode "split", go to stages). The
arithmetic is the experts module's "all" path step for step (same packing, same grouping of
positions into kernel calls, same float32 rows summed on the device in the same dtype), so a host
step's tokens are the segmented step's, bit for bit.

Mode "split" (the guard's "model" arm: the link and the CPU side by side) is mode "host" whose
host node also fetches: of a layer's M distinct non-resident experts it hands ``plan[M]`` (the
cost model's split, :meth:`HostSteps.refresh_plan`; those with the most positions) to the native
scheduler at band 0, each into a stage (a device buffer of one expert, ``HostSteps.stages``),
computes the others, then waits for the copies (``pf_layer``'s fetching: the host node blocks on
the scheduler's condition variable, no CUDA call) and writes where each landed (``stage_of``, a
page-locked int32 row per layer). After the host node the device copies that row up and runs the
fused kernel a second time, from the stages; the three parts (hits, stages, the CPU's rows) are
zero where another computed, so their sum is exact. Stages are not the cache: a staged expert is
gone after its layer (stream order keeps the next layer's copies behind this layer's kernel: a
host node starts only after the work queued before it has finished), and the cache changes only
between steps (hot experts computed on the CPU are queued into it in the background band after
the step, :meth:`HostSteps.finish`). The wait after the CPU's share is the step's exposed fetch
time, counted where the host node waits.

Route-ahead in mode "split" (``PDFLASH_ROUTE_AHEAD=0``: off): the device also applies the next
layer's router to each layer's residual stream after attention and copies its top-k down with the
routing; the host node first submits up to m of those predicted experts (not resident in the next
layer) at band 1 into the next layer's set of stages (two sets, by layer parity), then does its own
work. The next layer's host node claims the prefetches it is routed to (promoted to band 0,
waited for after its kernel call, computed by the device from the stage) and cancels the others.
m comes from the cost model (:meth:`CpuPlacement.split_plan`); where route-ahead is on (m > 0) the
in-layer plan fetches nothing and no background fills are queued: the link is the prefetches'.

Bookkeeping the experts module does per layer (routing observers, per-layer CPU counts, the
runner's kept-current rate) happens after the step, from the routing left in the host buffers:
observers see every layer's experts once the step has finished instead of while it runs, and
nothing is prefetched during a host step (nothing is fetched under "all").

Ownership: a :class:`HostSteps` (one per runtime, made by :meth:`HostSteps.for_runtime`) owns its
buffers and its :class:`~pdflash.native.cpu_experts.CpuLayer` contexts; ``close`` synchronises the
device first (a captured host node must not run after its context is gone) and runs before the
runtime closes its CPU kernel. On the CPU device (tests) the host node is a direct call: the same
step function runs eagerly.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections import Counter

import torch

from pdflash import PdflashError
from pdflash.native import Band
from pdflash.native.cpu_experts import LayerReport
from pdflash.offload.host_store import host_register, host_unregister
from pdflash.offload.mxfp4_triton import _kernels, triton_available


def _launcher(device: torch.device):
    """fn(host_fn, arg): the host function queued on the current stream (CUDA), or run now (CPU)."""
    if device.type != "cuda":
        return None
    from pdflash.native import _find_cudart

    path = _find_cudart()
    if path is None:
        torch.empty(1, device=device)  # make PyTorch load its CUDA runtime
        path = _find_cudart()
    if path is None:
        raise PdflashError("host steps need PyTorch's CUDA runtime (libcudart) loaded in this process")
    fn = ctypes.CDLL(path).cudaLaunchHostFunc
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    fn.restype = ctypes.c_int

    def launch(host_fn: int, arg: int) -> None:
        rc = fn(ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream), ctypes.c_void_p(host_fn),
                ctypes.c_void_p(arg))
        if rc != 0:
            raise PdflashError(f"cudaLaunchHostFunc failed (CUDA error {rc})")

    return launch


WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: the write follows the work before it
RELAY_SPIN_US = 2000  # a relay's wait for a down flag spins this long, then sleeps between reads
RELAY_TIMEOUT_S = 30.0  # the longest a relay waits for one layer's down flag


def handoff_mode() -> str:
    """How a host step hands a layer to the CPU: ``flags`` (stream memory operations and a relay
    thread, the default) or ``node`` (host nodes), from ``PDFLASH_HOST_HANDOFF``."""
    mode = os.environ.get("PDFLASH_HOST_HANDOFF", "flags")
    return mode if mode in ("flags", "node") else "flags"


class _Flags:
    """Relay flags on CUDA: an int32 host buffer page-locked and mapped for the device, its
    device address, and the driver's stream write / wait (cuStreamWriteValue32 /
    cuStreamWaitValue32) to queue on the current stream. :meth:`make` returns None where any of
    that is missing or a probe (one write and one wait, run now) fails."""

    def __init__(self, host: torch.Tensor, dev_ptr: int, write, wait, device: torch.device):
        self.host, self.dev_ptr, self._write, self._wait, self.device = host, dev_ptr, write, wait, device
        self.layers = host.numel() // 2

    @classmethod
    def make(cls, layers: int, device: torch.device) -> "_Flags | None":
        from pdflash.native import _find_cudart

        try:
            libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        fns = []
        for names in (("cuStreamWriteValue32_v2", "cuStreamWriteValue32"),
                      ("cuStreamWaitValue32_v2", "cuStreamWaitValue32")):
            fn = next((getattr(libcuda, n) for n in names if hasattr(libcuda, n)), None)
            if fn is None:
                return None
            fn.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
            fn.restype = ctypes.c_int
            fns.append(fn)
        torch.empty(1, device=device)  # the runtime and its context loaded
        path = _find_cudart()
        if path is None:
            return None
        cudart = ctypes.CDLL(path)
        host = torch.zeros(2 * layers, dtype=torch.int32)
        if not host_register(host, mapped=True):
            return None
        dev = ctypes.c_void_p()
        flags = None
        if cudart.cudaHostGetDevicePointer(ctypes.byref(dev), ctypes.c_void_p(host.data_ptr()), ctypes.c_uint(0)) == 0:
            flags = cls(host, int(dev.value or 0), fns[0], fns[1], device)
            if not flags.dev_ptr or not flags._probe():
                flags = None
        if flags is None:
            host_unregister(host)
        return flags

    def _probe(self) -> bool:
        """One write and one (already satisfied) wait on the current stream: both must land."""
        self.host.zero_()
        self.host[self.layers] = 1
        try:
            self.signal(0, check_capture=False)
            torch.cuda.current_stream(self.device).synchronize()
        except (PdflashError, RuntimeError):
            return False
        ok = int(self.host[0]) == 1
        self.host.zero_()
        return ok

    def signal(self, layer: int, check_capture: bool = True) -> None:
        """Queue layer ``layer``'s hand-off on the current stream: write its down flag, wait for
        its up flag."""
        if check_capture and not torch.cuda.is_current_stream_capturing():
            raise PdflashError("relay flags are queued only inside a capture (its replays are armed)")
        self.write(layer)
        self.wait(layer)

    def write(self, layer: int) -> None:
        """Queue the write of layer ``layer``'s down flag (1) on the current stream."""
        self._check(self._write(self._stream(), self.dev_ptr + 4 * layer, 1, WRITE_DEFAULT))

    def wait(self, layer: int) -> None:
        """Queue a wait for layer ``layer``'s up flag (>= 1) on the current stream."""
        self._check(self._wait(self._stream(), self.dev_ptr + 4 * (self.layers + layer), 1, WAIT_GEQ))

    def _stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    @staticmethod
    def _check(rc: int) -> None:
        if rc:
            raise PdflashError(f"a stream memory operation failed (CUDA driver error {rc})")

    def close(self) -> None:
        host_unregister(self.host)


def _host_buffer(n: int, dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, bool]:
    """A host tensor of n elements, page-locked where ``pin`` (registered in place, so that
    PyTorch's pinned allocator records no events on it inside a capture; its allocator if
    registration fails). Returns (tensor, registered)."""
    t = torch.zeros(n, dtype=dtype)
    if not pin:
        return t, False
    if host_register(t):
        return t, True
    return torch.zeros(n, dtype=dtype, pin_memory=True), False


def host_steps_enabled() -> bool:
    """Host steps are on unless ``PDFLASH_HOST_STEPS=0`` (then graphed steps run as segments)."""
    return os.environ.get("PDFLASH_HOST_STEPS", "1") != "0"


def route_ahead_enabled() -> bool:
    """Split host steps prefetch the next layer's predicted experts unless ``PDFLASH_ROUTE_AHEAD=0``."""
    return os.environ.get("PDFLASH_ROUTE_AHEAD", "1") != "0"


STAGES = 8  # most experts one layer of a "split" step fetches (stages: min(STAGES, 2 * top_k) a set)
STAGE_KEY = 1 << 31  # task keys of staged fetches: make_key(layer, STAGE_KEY + expert)
PLAN_EVERY = 16  # steps between two plans of the cost model's split (the rates move slowly)


def step_timeline(launched_ns: int, done_ns: int, runs: list[tuple[int, float, int, float]]) -> dict[str, float]:
    """Where one host step's wall time went, in seconds, from its launch and end
    (``time.monotonic_ns``) and each layer's host node run in order: (start ns on the same
    clock, wall seconds, kernel ns, seconds waited for fetches). ``head`` (launch to the first
    node: the embedding, the first attention, the launch itself) + ``node`` (inside the host
    nodes) + ``gaps`` (between one node's end and the next one's start: the device's work
    between them, the copies and the hand-offs) + ``tail`` (the last node's end to the step's
    end) = ``step``; of ``node``, ``kernel`` is the CPU kernel's calls and ``fetch_wait`` the
    wait for the link after them."""
    ends = [b + round(sec * 1e9) for b, sec, _, _ in runs]
    gaps = sum(runs[i][0] - ends[i - 1] for i in range(1, len(runs)))
    return {"step": (done_ns - launched_ns) / 1e9, "head": (runs[0][0] - launched_ns) / 1e9,
            "node": sum(sec for _, sec, _, _ in runs), "kernel": sum(k for _, _, k, _ in runs) / 1e9,
            "fetch_wait": sum(w for _, _, _, w in runs), "gaps": gaps / 1e9, "tail": (done_ns - ends[-1]) / 1e9}


def moe_residual(residual: torch.Tensor, contrib: torch.Tensor | None, up: torch.Tensor, c_dtype: torch.dtype,
                 K: int) -> torch.Tensor:
    """residual [..., H] + the layer's expert output from its rows, in one Triton kernel: the
    device's rows ``contrib`` [R*K, H] (``c_dtype``; None: every row the CPU's) plus the CPU's
    ``up`` [R*K, H] float32, summed over each row's K positions, in residual's dtype; the same
    bits as ``residual + (contrib.add_(up) or up.to(c_dtype)).view(R, K, H).sum(1).to(dtype)``
    (triton_kernels.moe_residual). All three contiguous, as a host step's are."""
    k = _kernels()
    H = residual.shape[-1]
    R = residual.numel() // H
    out = torch.empty_like(residual)
    BH = min(1024, k.triton.next_power_of_2(H))
    k.moe_residual[(R, k.triton.cdiv(H, BH))](residual, contrib if contrib is not None else up, up, out, H,
                                              K=K, HAS_C=contrib is not None, C_BF16=c_dtype == torch.bfloat16,
                                              X_BF16=residual.dtype == torch.bfloat16, BH=BH)
    return out


class HostLayer:
    """One layer's experts inside a host step of ``rows`` token rows (see the module docstring)."""

    def __init__(self, steps: "HostSteps", layer: int, rows: int, bufs: "_RowBuffers", mode: str):
        self.steps = steps
        self.mode = mode  # "all": every routed expert on the CPU; "host": the cache's hits on the device;
        # "split": "host" whose host node also fetches part of the misses into stages
        self.layer = layer
        self.rows = R = rows
        self.bufs = bufs
        K, H = steps.top_k, steps.hidden
        self.x_dtype = bufs.x_dtype
        self.down = down = bufs.down[layer]  # this layer's page-locked int16 words
        self.idx = down[: bufs.a].view(torch.int64)
        # "split" with route-ahead: the next layer's experts predicted from this layer's residual
        # stream (its router on it), copied down with the routing; this layer's host node prefetches them
        self.ahead = mode == "split" and layer + 1 < steps.num_layers and steps.route_ahead
        self.predicted = down[bufs.a: bufs.a2].view(torch.int64)
        runner = steps.runner
        structs = [runner.struct(layer, e) for e in range(steps.num_experts)]
        resident = steps.resident[layer] if mode in ("host", "split") else None
        self.stage_of = bufs.stage_of[layer]  # "split": where the last run's fetched experts landed
        fetch = steps.fetch_for(layer, bufs) if mode == "split" else None
        self.cpu = runner.kernel.layer(structs, K, R, self.idx, down[bufs.a2: bufs.b].view(torch.float32),
                                       down[bufs.b: bufs.n].view(self.x_dtype).view(R, H), bufs.up_host, resident,
                                       fetch)
        self.tokens = R
        self.launched = 0  # runs queued or done since the last check

    def __call__(self, x: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor,
                 predicted: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Inside the captured step: x [R, H], the router's weights and indices (and, where
        :attr:`ahead`, the next layer's predicted experts [R, K]) -> the layer's expert output
        [R, H] in x's dtype; with ``residual`` (the residual stream, R rows of H, x's dtype), the
        residual plus that output in its shape (the layer's output): on CUDA one kernel
        (:func:`moe_residual`) instead of the four ops it computes bit for bit."""
        s = self.steps
        R, K, H = self.rows, s.top_k, s.hidden
        idx = indices.reshape(R, -1)
        w = scores.reshape(R, -1)
        if w.shape[1] != idx.shape[1]:  # dense scores [R, E]: the routed ones, in top-k order
            w = w.gather(1, idx)
        out_dtype = torch.promote_types(s.dtype, w.dtype)
        bufs = self.bufs
        on_device = self.mode in ("host", "split")
        side = s.side if on_device else None
        if on_device:  # the hits from their cache slots, on the device (the experts module's fused path),
            # on the side stream where there is one: beside the host node instead of before it
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                contrib = self._fused(s.rt.cache.slots, s.slot_of[self.layer], x, idx, w, out_dtype)
        ahead = predicted.reshape(-1).to(torch.int64) if predicted is not None else bufs.no_prediction
        parts = (idx.to(torch.int64).contiguous().view(-1).view(torch.int16), ahead.contiguous().view(torch.int16),
                 w.to(torch.float32).contiguous().view(-1).view(torch.int16),
                 x.to(self.x_dtype).contiguous().view(-1).view(torch.int16))
        torch.cat(parts, out=bufs.pack)
        self.down[: bufs.n].copy_(bufs.pack, non_blocking=True)
        if s.launch is None:  # the CPU device: the host node's call, made (and checked) now
            self.cpu.run()
        elif s.flags is not None and torch.cuda.is_current_stream_capturing():  # the relay runs it
            s.flags.signal(self.layer)
        else:
            s.launch(self.cpu.host_fn, self.cpu.handle)
            if not torch.cuda.is_current_stream_capturing():  # a capture records it: see replayed()
                self.launched += 1
        bufs.up_dev.copy_(bufs.up_host, non_blocking=True)
        if side is not None:  # the hits' rows, joined back before they are summed
            torch.cuda.current_stream(x.device).wait_stream(side)
        if self.mode == "split":  # the fetched experts, from the stages the host node filled
            bufs.stage_dev.copy_(self.stage_of, non_blocking=True)
            contrib.add_(self._fused(s.stages[self.layer % len(s.stages)], bufs.stage_dev, x, idx, w, out_dtype))
        # the CPU's rows are zero where the device computed, and the reverse
        if residual is not None and s.fused_residual:
            return moe_residual(residual, contrib if on_device else None, bufs.up_dev, out_dtype, K)
        rows = contrib.add_(bufs.up_dev) if on_device else bufs.up_dev.to(out_dtype)
        out = rows.view(R, K, H).sum(dim=1).to(x.dtype)
        return out if residual is None else residual + out.view_as(residual)

    def _fused(self, slots: torch.Tensor, slot_of: torch.Tensor, x: torch.Tensor, idx: torch.Tensor,
               w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Every position's expert from its slot of ``slots`` (``slot_of``: expert -> slot, -1 where
        it is not there: such a pair reads slot 0 and is masked to zero) -> [R*K, H] rows."""
        s = self.steps
        R, K, H = self.rows, s.top_k, s.hidden
        slot = slot_of.index_select(0, idx.reshape(-1))  # [R*K]
        work = torch.stack((self.bufs.pairs, slot))  # the kernels read nothing for slot -1
        fused = s.fused
        h = torch.empty((R * K, fused.inter), dtype=s.dtype, device=x.device)
        contrib = torch.empty((R * K, H), dtype=out_dtype, device=x.device)
        fused.run(slots, x.contiguous(), w.reshape(-1).contiguous(), work, h, contrib, K)
        return torch.where((slot >= 0)[:, None], contrib, torch.zeros((), dtype=out_dtype, device=x.device))

    def replayed(self) -> None:
        """A graph holding this layer's host node was launched (its run is then checked by
        :meth:`HostSteps.finish`)."""
        self.launched += 1

    def set_tokens(self, tokens: int) -> None:
        if tokens != self.tokens:
            self.cpu.set_tokens(tokens)
            self.tokens = tokens


class _RowBuffers:
    """The buffers of host steps of ``rows`` rows, shared by their layers (the stream runs one
    layer at a time): the device pack buffer, every layer's page-locked down row (kept per layer:
    the routing is read after the step), the page-locked up buffer and its device copy. Never
    reallocated: captured graphs hold their addresses."""

    def __init__(self, steps: "HostSteps", rows: int, x_dtype: torch.dtype):
        K, H = steps.top_k, steps.hidden
        self.x_dtype = x_dtype
        self.a = rows * K * 4  # int16 words of the indices (int64)
        self.a2 = 2 * self.a  # ... then of the next layer's predicted experts (int64, -1: none)
        self.b = self.a2 + rows * K * 2  # ... then of the weights (float32)
        self.n = self.b + rows * H * (x_dtype.itemsize // 2)  # ... then of the rows
        words = -(-self.n // 8) * 8  # every layer's row 16-byte aligned
        self.pack = torch.empty(self.n, dtype=torch.int16, device=steps.device)
        self.down = steps._buffer(steps.num_layers * words, torch.int16).view(steps.num_layers, words)
        self.up_host = steps._buffer(rows * K * H, torch.float32).view(rows * K, H)
        self.up_dev = torch.empty((rows * K, H), dtype=torch.float32, device=steps.device)
        self.pairs = torch.arange(rows * K, dtype=torch.int32, device=steps.device)
        self.no_prediction = torch.full((rows * K,), -1, dtype=torch.int64, device=steps.device)
        E = steps.num_experts  # mode "split": the plan, where each layer's fetches landed, its device copy
        self.plan = steps._buffer(rows * K + 1, torch.uint8)
        self.plan_key: tuple | None = None  # (tokens, plan period, inputs measured) the plan was made for (refresh_plan)
        self.ahead_most = 0  # route-ahead: prefetches each host node makes for the next layer (refresh_plan)
        self.stage_of = steps._buffer(steps.num_layers * E, torch.int32).view(steps.num_layers, E)
        self.stage_of.fill_(-1)
        self.stage_dev = torch.full((E,), -1, dtype=torch.int32, device=steps.device)


class HostSteps:
    """The host steps of one runtime: per row count, every layer's :class:`HostLayer` and its buffers."""

    def __init__(self, rt):
        self.rt = rt
        self.runner = rt.cpu
        self.device = rt.device
        self.dtype = rt.dtype
        self.num_layers = rt.family.num_layers
        self.num_experts = rt.family.num_experts
        self.top_k = rt.family.top_k
        self.hidden = self.runner.hidden
        self.launch = _launcher(self.device)
        self._pin = self.device.type == "cuda"
        self._registered: list[torch.Tensor] = []
        self._layers: dict[tuple[int, str], list[HostLayer]] = {}  # (rows, mode) -> one HostLayer per layer
        self._reports: dict[tuple[int, str], LayerReport] = {}  # (rows, mode) -> its layers' figures in one call
        self._bufs: dict[int, _RowBuffers] = {}  # rows -> buffers (one mode runs at a time)
        # the cache's resident set as the host steps of mode "host" see it (sync_cache, before each)
        L, E = self.num_layers, self.num_experts
        self.resident = torch.zeros((L, E), dtype=torch.uint8)  # read by the host nodes
        self.slot_of = torch.full((L, E), -1, dtype=torch.int32, device=self.device)  # read on the device
        self._slots_host: dict[tuple[int, int], int] = {}  # (layer, expert) -> slot, as slot_of holds it
        self._version = None
        experts = rt.family.decoder_layers(rt.model)[0].mlp.experts
        self.fused = experts.kernel.fused(self.device) if hasattr(experts, "kernel") else None
        # each layer's expert output into the residual stream in one kernel (PDFLASH_FUSED_RESIDUAL=0: torch ops)
        self.fused_residual = triton_available(self.device, "PDFLASH_FUSED_RESIDUAL")
        # mode "split": [sets, stages, expert bytes] (made on first use); layer i uses set i % sets: two
        # with route-ahead (layer i's host node fills layer i+1's set while the device still reads its own)
        self.stages: torch.Tensor | None = None
        self.route_ahead = route_ahead_enabled()  # "split": each host node prefetches the next layer's predicted experts
        # modes "host" and "split" on CUDA: the hits' fused call runs on this stream, beside the
        # host node (PDFLASH_HOST_SIDE_STREAM=0: before it, on the step's stream)
        side = self.device.type == "cuda" and os.environ.get("PDFLASH_HOST_SIDE_STREAM", "1") != "0"
        self.side = torch.cuda.Stream(self.device) if side else None
        # the hand-off (module docstring): relay flags and the relay thread, or host nodes
        self.flags = _Flags.make(self.num_layers, self.device) if self._pin and handoff_mode() == "flags" else None
        self.relay = self.runner.kernel.relay(self.flags.host, RELAY_SPIN_US) if self.flags is not None else None
        self.steps_run = 0
        self._closed = False

    @classmethod
    def for_runtime(cls, rt) -> "HostSteps | None":
        """The runtime's HostSteps (made on first use), or None where host steps cannot run: no
        native CPU runner whose layers run as host steps (another family, or ``--cpu-experts off``)."""
        if not getattr(getattr(rt, "cpu", None), "host_steps", False):
            return None
        steps = rt.__dict__.get("_host_steps")
        if steps is None or steps._closed:
            steps = rt.__dict__["_host_steps"] = cls(rt)
        return steps

    def _buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        t, registered = _host_buffer(n, dtype, self._pin)
        if registered:
            self._registered.append(t)
        return t

    def can_run(self, mode: str, rows: int) -> bool:
        """Mode "all" always; "host" where the hits' fused kernel runs (CUDA, up to its token count);
        "split" where "host" runs and the runtime has a scheduler and a cost model to plan with."""
        from pdflash.offload.mxfp4_triton import MAX_TOKENS as FUSED_MAX_TOKENS

        if mode == "all":
            return True
        fused = self.fused is not None and rows <= FUSED_MAX_TOKENS
        if mode == "host":
            return fused
        return (mode == "split" and fused and getattr(self.rt, "scheduler", None) is not None
                and getattr(self.rt, "placer", None) is not None)

    @property
    def stages_per_set(self) -> int:
        return min(STAGES, 2 * self.top_k)

    def fetch_for(self, layer: int, bufs: "_RowBuffers"):
        """The LayerFetch of one layer's host node in mode "split": the layer's experts' host rows,
        its set of stages (allocated on first use: ``stages_per_set`` experts' bytes a set on the
        device, beside the cache; two sets with route-ahead), keys apart from the cache's own
        (``make_key(layer, STAGE_KEY + expert)``)."""
        from pdflash.native import make_key
        from pdflash.native.cpu_experts import LayerFetch

        rt = self.rt
        if self.stages is None:
            sets = 2 if self.route_ahead and self.num_layers > 1 else 1
            self.stages = torch.empty((sets, self.stages_per_set, rt.cache.slots.shape[1]), dtype=torch.uint8,
                                      device=self.device)
        host = rt.host
        return LayerFetch(rt.scheduler, [host.row(layer, e).data_ptr() for e in range(self.num_experts)],
                          int(rt.cache.slots.shape[1]), [t.data_ptr() for t in self.stages[layer % len(self.stages)]],
                          make_key(layer, STAGE_KEY), bufs.plan, bufs.stage_of[layer])

    def before_step(self, mode: str, rows: int, tokens: int) -> None:
        """What a step (or a capture's warm-up) of ``mode`` reads must be current: the cache's
        slot table and resident map ("host", "split") and the fetch plan ("split")."""
        if mode in ("host", "split"):
            self.sync_cache()
        if mode == "split":
            self.refresh_plan(rows, tokens)

    def invalidate_plans(self) -> None:
        """Make every plan again before its next step (the runtime's cache and statistics were reset)."""
        for bufs in self._bufs.values():
            bufs.plan_key = None

    def refresh_plan(self, rows: int, tokens: int) -> None:
        """Before a step of mode "split": the plan its host nodes read (``plan[M]``: experts to fetch
        of M non-resident ones, the cost model's per-layer split, ``CpuPlacement.fetch_plan``),
        made again when the token count changed, every ``PLAN_EVERY`` steps (the rates move), and
        as soon as an input the first plan had to assume is measured: the split steps' own gaps
        (after the first split step) and route-ahead's precision (after ``AHEAD_SAMPLES``
        prefetches). A guard's first window of split steps is then run on the plan its steps
        would keep, not on the assumed one."""
        from pdflash.offload.cpu_compute import AHEAD_SAMPLES

        bufs = self._bufs[rows]
        fs = self.rt.cache.stats
        measured = (fs.host_step_mean_s("gaps", ("split",)) is not None, fs.route_ahead_sent >= AHEAD_SAMPLES)
        key = (tokens, self.steps_run // PLAN_EVERY, measured)
        if bufs.plan_key == key:
            return
        plan, most = self.rt.placer.split_plan(tokens, self.top_k, self.stages_per_set, self.num_experts,
                                               self.gap_seconds(), self.route_ahead)
        bufs.plan.zero_()
        bufs.plan[: len(plan)].copy_(torch.tensor(plan, dtype=torch.uint8))
        layers = self._layers.get((rows, "split"), [])
        for lay, nxt in zip(layers[:-1], layers[1:]):  # between steps: no host node runs
            if lay.ahead:
                lay.cpu.set_ahead(nxt.cpu, lay.predicted, most)
        bufs.plan_key, bufs.ahead_most = key, most

    def gap_seconds(self) -> float | None:
        """Mean time between two host nodes: over the split steps so far (the window route-ahead's
        prefetches get: their gaps include the stages' fused call), else over every host step;
        None before any."""
        if self.num_layers < 2:
            return None
        fs = self.rt.cache.stats
        gaps = fs.host_step_mean_s("gaps", ("split",))
        if gaps is None:
            gaps = fs.host_step_mean_s("gaps")
        return gaps / (self.num_layers - 1) if gaps is not None else None

    def sync_cache(self) -> None:
        """Before a host step of mode "host": the resident map and slot table from the cache
        (copied only when its resident set changed; nothing else runs while a step does, so it holds)."""
        cache = self.rt.cache
        if cache.version == self._version:
            return
        held = cache.resident_slots()
        self._slots_host = {(layer, e): s for layer, e, s in held}
        table = torch.full(self.slot_of.shape, -1, dtype=torch.int32)
        if held:  # one indexed write, not one per expert
            where = torch.tensor(held, dtype=torch.int64).T
            table[where[0], where[1]] = where[2].to(torch.int32)
        self.resident.copy_(table >= 0)
        self.slot_of.copy_(table)  # queued before the replay on the same stream
        self._version = cache.version
        cache.stats.host_table_syncs += 1

    def layers(self, rows: int, x_dtype: torch.dtype, mode: str = "all") -> list[HostLayer]:
        """Every layer's HostLayer for steps of ``rows`` rows in ``mode`` (built on first use)."""
        if self._closed:
            raise PdflashError("the runtime's host steps are closed")
        got = self._layers.get((rows, mode))
        if got is None:
            bufs = self._bufs.get(rows)
            if bufs is None:
                bufs = self._bufs[rows] = _RowBuffers(self, rows, x_dtype)
            got = self._layers[(rows, mode)] = [HostLayer(self, i, rows, bufs, mode) for i in range(self.num_layers)]
            self._reports[(rows, mode)] = LayerReport([lay.cpu for lay in got])
            if mode == "split":
                bufs.plan_key = None  # its route-ahead is set with the next plan
            for lay, nxt in zip(got[:-1], got[1:]):
                lay.cpu.set_prewake(self.runner.prewake_us)  # the next layer's call comes a segment later
                if lay.ahead:  # how many: refresh_plan's (the cost model's), none until then
                    lay.cpu.set_ahead(nxt.cpu, lay.predicted, 0)
        return got

    def replay(self, graph, layers: list[HostLayer]) -> None:
        """Launch a captured step of ``layers`` and wait for it: with the relay, armed with the
        layers first and collected after (on any failure cancelled, so the device never waits
        for ever); each layer's run is then checked by :meth:`finish`."""
        relay = self.relay
        if relay is not None:
            relay.arm([lay.cpu for lay in layers], RELAY_TIMEOUT_S)
        try:
            graph.replay()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        except BaseException:
            if relay is not None:
                relay.cancel()
                with contextlib.suppress(PdflashError):
                    relay.wait(RELAY_TIMEOUT_S)
            raise
        if relay is not None:
            relay.wait(RELAY_TIMEOUT_S)
        if self.device.type == "cuda":  # the CPU device's host calls ran (and were checked) in the step
            for lay in layers:
                lay.replayed()

    def finish(self, layers: list[HostLayer], tokens: int, launched_ns: int | None = None,
               done_ns: int | None = None) -> None:
        """After a step (its work finished): check every layer's run, then do the experts
        module's bookkeeping (see the module docstring). With ``launched_ns`` and ``done_ns``
        (``time.monotonic_ns`` just before the step was launched and once it had finished), the
        step's timeline is added to the statistics (:func:`step_timeline`), with ``bookkeeping``:
        this method's own time, after the step and not part of it."""
        began_ns = time.monotonic_ns()
        rt, runner = self.rt, self.runner
        stats = rt.cache.stats
        K = self.top_k
        mode = layers[0].mode
        launched = [lay.launched for lay in layers]
        for lay in layers:
            lay.launched = 0
        figures = self._reports[(layers[0].rows, mode)].check(launched)  # raises where a run failed
        every = layers[0].bufs.down[:, : layers[0].bufs.a].view(torch.int64)  # [layers, R*K]: each layer's idx
        routed = every[[lay.layer for lay in layers], : tokens * K].tolist()
        split, on_device = mode == "split", mode in ("host", "split")
        slot_of = self._slots_host
        hot = []  # "split": each layer's CPU experts, offered to the cache once every hit is counted
        staged = layers[0].bufs.stage_of.tolist() if split else None  # [layer][expert]: stage or -1
        runs = []  # (start ns, wall s, kernel ns, fetch wait s) of each layer's host node
        for lay, idx, (seconds, begin, kernel, waited, sent, used, unused) in zip(layers, routed, figures):
            layer = lay.layer
            layer_stats = stats.layers[layer]
            if split:  # route-ahead: prefetches sent for the next layer, this layer's claimed / cancelled
                if sent:
                    stats.prefetch_issued[Band.ROUTE_AHEAD] = stats.prefetch_issued.get(Band.ROUTE_AHEAD, 0) + sent
                stats.route_ahead_sent += sent
                stats.route_ahead_used += used
                stats.route_ahead_cancelled += unused
                layer_stats.promoted += used
            else:
                waited = 0.0
            runs.append((begin, seconds, kernel, waited))
            counts = Counter(idx) if tokens > 1 else dict.fromkeys(idx, 1)  # one token: distinct top-k experts
            experts = sorted(counts)
            if not on_device:  # "all": every routed expert on the CPU
                on_cpu, cpu_experts, fetched = [counts[e] for e in experts], experts, 0
            else:
                on_cpu, cpu_experts, fetched = [], [], 0
                stage_row = staged[layer] if split else None
                for e in experts:
                    s = slot_of.get((layer, e))
                    if s is not None:  # computed on the device from its slot
                        rt.cache.count_hit(layer, s)
                    elif split and stage_row[e] >= 0:  # fetched into a stage
                        fetched += 1
                    else:
                        on_cpu.append(counts[e])
                        cpu_experts.append(e)
            layer_stats.cpu += len(on_cpu)
            if split:
                layer_stats.misses += fetched
                stats.demand_fetches += fetched
                if fetched:
                    layer_stats.exposed_s += waited
                    layer_stats.waits += 1
                if not lay.bufs.ahead_most:  # with route-ahead the link carries the prefetches the cost
                    # model planned for it; background fills beside them would take the link from them
                    hot.append((layer, cpu_experts))
            kernel_s = kernel / 1e9  # the CPU's share: a split node's fetch wait is the link's
            stats.cpu_seconds += kernel_s
            runner.account(on_cpu, kernel_s)
            rt._on_routed(layer, experts)
        for layer, experts in hot:  # hot ones go to the cache in the background (this may evict a hit's slot)
            rt.placer.note_host(layer, experts)
        if launched_ns is not None and done_ns is not None:
            parts = step_timeline(launched_ns, done_ns, runs)
            parts["bookkeeping"] = (time.monotonic_ns() - began_ns) / 1e9  # after the step: this method's work
            stats.add_host_step(mode, parts)
        stats.host_steps += 1
        self.steps_run += 1
        rt.cache.sync_point()

    def close(self) -> None:
        """Synchronise the device, then free the contexts and unregister the buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.relay is not None:  # an armed step names the layers
            self.relay.close()
        if self.flags is not None:
            self.flags.close()
        self._reports.clear()
        for made in self._layers.values():
            for lay in made:
                lay.cpu.close()
        self._layers.clear()
        for t in self._registered:
            host_unregister(t)
        self._registered.clear()
