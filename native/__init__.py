"""The native priority-banded fetch scheduler.

Every expert byte pdflash moves goes through one :class:`Scheduler`. It wraps
the C library in ``pf_sched.c`` (built by ``build_ffi.py`` through cffi's API
mode): worker threads copy tasks chunk by chunk, most urgent priority first.

    from pdflash.native import Scheduler, Band
    with Scheduler(backend="memcpy", workers=2, link_gbps=20) as s:
        t = s.submit(make_key(3, 7), src_tensor, dst_tensor, priority=Band.ROUTE_AHEAD)
        assert s.wait(t) is WaitStatus.DONE

Caller contract: src and dst stay alive and untouched until the ticket ends or
``reset()`` / ``close()`` returns. The wrapper keeps a reference to tensors and
buffers passed in until then: a wait that returns CLOSED does not release them
(a chunk may still be landing), only ``close()`` does, after joining the workers.

Device ordering (cuda backend): a copy into a CUDA tensor first waits, on the
device, for the work already queued on that device's current PyTorch stream (an
event recorded at submit; ``after=`` passes one of the caller's own instead), and
a ticket ends DONE only after its bytes have landed, so kernels launched after
``wait`` returns read them.
"""

from __future__ import annotations

import enum
import operator
import os
import threading
from typing import Any

from pdflash import PdflashError

NUM_PRIORITY = 20
DEFAULT_CHUNK_BYTES = 4 << 20


class Band(enum.IntEnum):
    """Named priority levels (lower number is served first)."""

    ON_DEMAND = 0
    ROUTE_AHEAD = 1
    BACKGROUND = 2


class WaitStatus(enum.Enum):
    DONE = 0
    CANCELLED = 1
    TIMEOUT = 2
    FAILED = 3
    CLOSED = 4
    PENDING = 5
    EXPIRED = 6


class SchedulerError(PdflashError):
    """A scheduler call was refused (bad argument, conflict, backend failure)."""


class SchedulerClosed(SchedulerError):
    """The scheduler was closed; create a new one."""


class NativeLibraryMissing(PdflashError):
    """The compiled library is not importable."""


def make_key(layer: int, expert: int) -> int:
    """64-bit task key of one (layer, expert)."""
    if not (0 <= layer < 2**32 and 0 <= expert < 2**32):
        raise SchedulerError(f"layer and expert must be in [0, 2**32): got ({layer}, {expert})")
    return (layer << 32) | expert


def split_key(key: int) -> tuple[int, int]:
    return key >> 32, key & 0xFFFFFFFF


def _load():
    try:
        from pdflash.native import _pf_sched  # type: ignore[attr-defined]
    except ImportError as exc:
        raise NativeLibraryMissing(
            f"the native scheduler is not built ({exc}); run 'pdflash build-native' or 'pip install -e .'"
        ) from None
    return _pf_sched.ffi, _pf_sched.lib


_STAT_FIELDS = (
    "submitted",
    "deduplicated",
    "promoted",
    "cancelled",
    "completed",
    "failed",
    "bytes",
    "queue_depth",
    "in_flight",
    "queue_wait_ns",
    "max_queue_wait_ns",
    "transfer_ns",
    "stall_ns",
    "stall_waits",
)


def _find_cudart() -> str | None:
    """Path of the CUDA runtime already mapped into this process (PyTorch's), if any."""
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


class _Pin:
    """Resolve a submit argument to (address, size in bytes, owner to keep alive)."""

    @staticmethod
    def resolve(obj: Any, ffi, what: str, want_device: str | None, device_index: int):
        if isinstance(obj, int):
            if obj <= 0:
                raise SchedulerError(f"{what} address must be a positive integer, got {obj}")
            return obj, None, None
        if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch.Tensor
            if not obj.is_contiguous():
                raise SchedulerError(f"{what} tensor must be contiguous")
            dev = obj.device.type
            if want_device == "cuda" and what == "dst":
                if dev != "cuda" or (obj.device.index or 0) != device_index:
                    raise SchedulerError(
                        f"dst tensor must be on cuda:{device_index} for the cuda backend, got {obj.device}"
                    )
            elif dev != "cpu":
                raise SchedulerError(f"{what} tensor must be in host memory for this backend, got {obj.device}")
            return obj.data_ptr(), obj.numel() * obj.element_size(), obj
        try:
            buf = ffi.from_buffer(obj, require_writable=(what == "dst"))
        except TypeError:
            raise SchedulerError(
                f"{what} must be a torch tensor, a buffer object or an integer address, got {type(obj).__name__}"
            ) from None
        except (ValueError, BufferError) as exc:  # non-contiguous, or a read-only destination
            raise SchedulerError(f"{what} buffer cannot be used: {exc}") from None
        return int(ffi.cast("uintptr_t", buf)), len(buf), (obj, buf)


class Scheduler:
    """A running pf_sched. Thread-safe; ``close()`` is terminal, ``reset()`` is not."""

    def __init__(
        self,
        backend: str = "memcpy",
        workers: int = 2,
        link_gbps: float | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        device: int = 0,
        latency_us: float = 0.0,
        history: int = 1 << 16,
        trace: int = 0,
        fault_every: int = 0,
        fault_max: int = 0,
        paced: bool = False,
    ):
        """``link_gbps`` (GB/s, shared by all workers): on the memcpy backend a simulated link; on
        the cuda backend the real copies are paced to it (each chunk is copied at once but lands,
        for ``wait`` and the statistics, no earlier than its slot on the link ends). ``latency_us``
        adds a fixed cost per chunk on either backend when ``link_gbps`` is set.

        ``fault_every`` and ``paced`` are test aids of the memcpy backend: every Nth chunk copy
        fails after writing half of it (at most ``fault_max`` times, 0: no limit); ``paced`` writes each chunk in slices across its simulated
        link time (needs ``link_gbps``), so the destination changes until the chunk lands."""
        ffi, lib = _load()
        self._ffi, self._lib = ffi, lib
        if backend not in ("memcpy", "cuda"):
            raise SchedulerError(f"unknown backend {backend!r}: use 'memcpy' or 'cuda'")
        if workers < 1:
            raise SchedulerError(f"workers must be at least 1, got {workers}")
        if chunk_bytes < 4096:
            raise SchedulerError(f"chunk_bytes must be at least 4096, got {chunk_bytes}")
        if link_gbps is not None and not (0 < link_gbps < float("inf")):
            raise SchedulerError(f"link_gbps must be a positive finite number, got {link_gbps}")
        if not (0 <= latency_us < float("inf")):
            raise SchedulerError(f"latency_us must be a finite number >= 0, got {latency_us}")
        if fault_every < 0 or fault_max < 0 or paced and link_gbps is None:
            raise SchedulerError("fault_every and fault_max must be >= 0, and paced needs link_gbps")
        self.backend = backend
        self.device = device
        self.workers = workers
        self.chunk_bytes = chunk_bytes
        self.link_gbps = link_gbps
        cfg = ffi.new("pf_config *")
        lib.pf_config_default(cfg)
        cfg.backend = lib.PF_BACKEND_CUDA if backend == "cuda" else lib.PF_BACKEND_MEMCPY
        cfg.workers = workers
        cfg.chunk_bytes = chunk_bytes
        cfg.link_gbps = link_gbps or 0.0
        cfg.latency_us = latency_us
        cfg.device = device
        cfg.history = history
        if trace < 0:
            raise SchedulerError(f"trace must be >= 0 (records kept), got {trace}")
        cfg.trace = trace
        cfg.fault_every = fault_every
        cfg.fault_max = fault_max
        cfg.paced = int(bool(paced))
        self.trace_capacity = trace
        keep = None
        if backend == "cuda":
            path = _find_cudart()
            if path is None:
                try:  # make PyTorch load its CUDA runtime, then look again
                    import torch

                    if torch.cuda.is_available():
                        torch.cuda.init()
                        torch.empty(1, device=f"cuda:{device}")
                except Exception:
                    pass
                path = _find_cudart()
            if path is not None:
                keep = ffi.new("char[]", path.encode())
                cfg.cudart_path = keep
        err = ffi.new("char[256]")
        out = ffi.new("pf_sched **")
        rc = lib.pf_create(cfg, out, err, 256)
        if rc != 0:
            raise SchedulerError(f"could not start the {backend} scheduler: {ffi.string(err).decode() or self._strerror(rc)}")
        self._s = out[0]
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._closed = False
        self._owners: dict[int, list] = {}  # ticket -> objects kept alive until it ends
        self._tls = threading.local()

    # -- plumbing -----------------------------------------------------------------
    def _strerror(self, rc: int) -> str:
        return self._ffi.string(self._lib.pf_strerror(rc)).decode()

    def _enter(self):
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed; create a new Scheduler")
            self._active += 1
        return self._s

    def _leave(self):
        with self._lock:
            self._active -= 1
            if self._closed and self._active == 0:
                self._idle.notify_all()

    def _check(self, rc: int, what: str) -> int:
        if rc >= 0:
            return rc
        if rc == self._lib.PF_ECLOSED:
            raise SchedulerClosed(f"{what}: the scheduler is closed")
        raise SchedulerError(f"{what}: {self._strerror(rc)}")

    @staticmethod
    def _priority(priority) -> int:
        try:
            p = operator.index(priority)
        except TypeError:
            raise SchedulerError(f"priority must be an integer or a Band, got {priority!r}") from None
        if not 0 <= p < NUM_PRIORITY:
            raise SchedulerError(f"priority must be in [0, {NUM_PRIORITY}), got {priority}")
        return p

    @staticmethod
    def _key(key) -> int:
        try:
            k = operator.index(key)
        except TypeError:
            raise SchedulerError(f"key must be an integer (see make_key), got {key!r}") from None
        if not 0 <= k < 2**64:
            raise SchedulerError(f"key must fit in 64 bits, got {k}")
        return k

    def _release(self, ticket: int, status: "WaitStatus") -> None:
        """Drop the references kept for a ticket once it has ended. CLOSED is not an end:
        a chunk may still be landing until close() has joined the workers."""
        if status not in (WaitStatus.TIMEOUT, WaitStatus.PENDING, WaitStatus.CLOSED):
            with self._lock:
                self._owners.pop(ticket, None)

    # -- API -----------------------------------------------------------------------
    def submit(self, key: int, src, dst, nbytes: int | None = None, priority=Band.BACKGROUND, after=None) -> int:
        """Queue a copy of ``nbytes`` from src to dst under ``key``; returns its ticket.

        src / dst: torch tensors, buffer objects or integer addresses. ``nbytes``
        defaults to the size of src (both must be known then) and may not exceed
        either buffer's size. A key already queued or in flight returns that
        task's ticket (promoted if ``priority`` is more urgent).

        ``after`` (cuda backend): a ``torch.cuda.Event`` the copy waits for on the device.
        By default a copy into a CUDA tensor waits for the work queued on the current
        stream of its device at submit time (one event recorded here); give a recorded
        event to share one among many submits.
        """
        p = self._priority(priority)
        key = self._key(key)
        want = "cuda" if self.backend == "cuda" else None
        src_addr, src_len, src_owner = _Pin.resolve(src, self._ffi, "src", want, self.device)
        dst_addr, dst_len, dst_owner = _Pin.resolve(dst, self._ffi, "dst", want, self.device)
        if nbytes is None:
            if src_len is None:
                raise SchedulerError("nbytes is required when src is a raw address")
            nbytes = src_len
        if nbytes <= 0:
            raise SchedulerError(f"nbytes must be positive, got {nbytes}")
        for name, size in (("src", src_len), ("dst", dst_len)):
            if size is not None and nbytes > size:
                raise SchedulerError(f"{name} holds {size} bytes but the copy needs {nbytes}")
        owners = [o for o in (src_owner, dst_owner) if o is not None]
        event = self._after_event(after, dst)
        if event is not None:
            owners.append(event)  # the event must outlive the task (pf_sched.h)
        handle = self._ffi.NULL if event is None else self._ffi.cast("void *", event.cuda_event)
        out = self._out_ticket()
        s = self._enter()
        try:
            rc = self._lib.pf_submit_after(s, key, self._ffi.cast("void *", src_addr), self._ffi.cast("void *", dst_addr),
                                           nbytes, p, handle, out)
            self._check(rc, "submit")
            ticket = int(out[0])
            if owners:
                with self._lock:
                    self._owners.setdefault(ticket, []).extend(owners)
                # it may have ended (and been waited for) before the owners were attached
                if self._lib.pf_query(s, ticket) != self._lib.PF_PENDING:
                    with self._lock:
                        self._owners.pop(ticket, None)
        finally:
            self._leave()
        return ticket

    def _after_event(self, after, dst):
        """The CUDA event a copy waits for, or None (memcpy backend, raw addresses)."""
        if self.backend != "cuda":
            return None
        if after is not None:
            if not hasattr(after, "cuda_event") or not after.cuda_event:
                raise SchedulerError("after must be a torch.cuda.Event that has been recorded")
            return after
        if not hasattr(dst, "data_ptr"):
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dst.device))
        return event

    def _out_ticket(self):
        """A per-thread uint64_t out-parameter, allocated once per thread."""
        out = getattr(self._tls, "ticket", None)
        if out is None:
            out = self._tls.ticket = self._ffi.new("uint64_t *")
        return out

    def wait(self, ticket: int, timeout: float | None = None) -> WaitStatus:
        """Block (GIL released) until the ticket ends or ``timeout`` seconds pass."""
        s = self._enter()
        try:
            rc = self._lib.pf_wait(s, ticket, -1.0 if timeout is None else float(timeout))
        finally:
            self._leave()
        if rc == self._lib.PF_ENOTICKET:
            raise SchedulerError(f"wait: ticket {ticket} was not issued by this scheduler")
        self._check(rc, "wait")
        status = WaitStatus(rc)
        self._release(ticket, status)
        return status

    def query(self, ticket: int) -> WaitStatus:
        """Non-blocking status: PENDING while queued or in flight."""
        s = self._enter()
        try:
            rc = self._lib.pf_query(s, ticket)
        finally:
            self._leave()
        if rc == self._lib.PF_ENOTICKET:
            raise SchedulerError(f"query: ticket {ticket} was not issued by this scheduler")
        status = WaitStatus(self._check(rc, "query"))
        self._release(ticket, status)
        return status

    def ticket_error(self, ticket: int) -> str:
        s = self._enter()
        try:
            buf = self._ffi.new("char[256]")
            self._lib.pf_ticket_error(s, ticket, buf, 256)
            return self._ffi.string(buf).decode()
        finally:
            self._leave()

    def promote(self, key: int, priority) -> bool:
        p = self._priority(priority)
        key = self._key(key)
        s = self._enter()
        try:
            return bool(self._check(self._lib.pf_promote(s, key, p), "promote"))
        finally:
            self._leave()

    def cancel(self, key: int) -> bool:
        key = self._key(key)
        s = self._enter()
        try:
            return bool(self._check(self._lib.pf_cancel(s, key), "cancel"))
        finally:
            self._leave()

    def cancel_band(self, priority) -> int:
        p = self._priority(priority)
        s = self._enter()
        try:
            return self._check(self._lib.pf_cancel_band(s, p), "cancel_band")
        finally:
            self._leave()

    def cancel_below_layer(self, layer: int, min_priority=0) -> int:
        p = self._priority(min_priority)
        if not 0 <= layer < 2**32:
            raise SchedulerError(f"layer must be in [0, 2**32), got {layer}")
        s = self._enter()
        try:
            return self._check(self._lib.pf_cancel_below_layer(s, layer, p), "cancel_below_layer")
        finally:
            self._leave()

    def reset(self) -> None:
        """Cancel queued work, let chunks in flight land, zero statistics. Not terminal."""
        s = self._enter()
        try:
            self._check(self._lib.pf_reset(s), "reset")
            # tasks submitted by other threads during the reset are still live: keep theirs
            with self._lock:
                tickets = list(self._owners)
            ended = [t for t in tickets if self._lib.pf_query(s, t) != self._lib.PF_PENDING]
            with self._lock:
                for t in ended:
                    self._owners.pop(t, None)
        finally:
            self._leave()

    def stats(self) -> dict:
        """Plain-dict statistics: one dict per priority level plus link totals (seconds)."""
        s = self._enter()
        try:
            st = self._ffi.new("pf_stats *")
            self._check(self._lib.pf_get_stats(s, st), "stats")
        finally:
            self._leave()
        levels = []
        for p in range(NUM_PRIORITY):
            lv = st.level[p]
            d = {name: int(getattr(lv, name)) for name in _STAT_FIELDS}
            d["priority"] = p
            d["queue_wait_s"] = d["queue_wait_ns"] / 1e9
            d["max_queue_wait_s"] = d["max_queue_wait_ns"] / 1e9
            d["transfer_s"] = d["transfer_ns"] / 1e9
            d["stall_s"] = d["stall_ns"] / 1e9
            levels.append(d)
        elapsed = (st.now_ns - st.since_ns) / 1e9
        return {
            "levels": levels,
            "link_busy_s": st.link_busy_ns / 1e9,
            "chunks": int(st.chunks),
            "waiting": int(st.waiting),
            "elapsed_s": elapsed,
            "backend": self.backend,
            "workers": self.workers,
        }

    def link_totals(self) -> tuple[int, float]:
        """(bytes landed over all levels, link busy seconds): the two counters a per-step cost
        model reads, without building :meth:`stats`' dicts."""
        s = self._enter()
        try:
            st = self._ffi.new("pf_stats *")
            self._check(self._lib.pf_get_stats(s, st), "stats")
        finally:
            self._leave()
        return sum(int(st.level[p].bytes) for p in range(NUM_PRIORITY)), st.link_busy_ns / 1e9

    def drain_trace(self) -> list[dict]:
        """Ended tasks since the last drain, oldest first (needs ``Scheduler(trace=N)``).

        Each: key, layer, expert, priority, status, nbytes, submit_s / start_s / end_s
        (seconds on the clock of ``time.monotonic()``; start_s is None if no chunk ever
        started). Older records beyond the trace capacity are dropped and counted in the
        ``dropped`` field of the first record.
        """
        if not self.trace_capacity:
            return []
        s = self._enter()
        try:
            buf = self._ffi.new("pf_trace_rec[]", self.trace_capacity)
            dropped = self._ffi.new("uint64_t *")
            n = self._check(self._lib.pf_trace_drain(s, buf, self.trace_capacity, dropped), "drain_trace")
        finally:
            self._leave()
        out = []
        for i in range(n):
            r = buf[i]
            out.append({
                "key": int(r.key),
                "layer": int(r.key) >> 32,
                "expert": int(r.key) & 0xFFFFFFFF,
                "ticket": int(r.ticket),
                "priority": int(r.priority),
                "status": WaitStatus(r.status).name.lower(),
                "nbytes": int(r.nbytes),
                "submit_s": r.submit_ns / 1e9,
                "start_s": r.start_ns / 1e9 if r.start_ns else None,
                "end_s": r.end_ns / 1e9,
            })
        if out:
            out[0]["dropped"] = int(dropped[0])
        return out

    def band_stats(self) -> list[dict]:
        """The three named bands' level statistics, with their names."""
        levels = self.stats()["levels"]
        return [dict(levels[b], band=int(b), name=b.name.lower().replace("_", "-")) for b in Band]

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Terminal and idempotent: wake every waiter with CLOSED, join workers, free memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._lib.pf_shutdown(self._s)  # every blocked call returns PF_CLOSED promptly
        with self._lock:
            while self._active:
                self._idle.wait()
            self._lib.pf_destroy(self._s)
            self._s = self._ffi.NULL
            self._owners.clear()

    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # safety net only; close() explicitly
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass


__all__ = [
    "Band",
    "NUM_PRIORITY",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerError",
    "NativeLibraryMissing",
    "WaitStatus",
    "make_key",
    "split_key",
]
