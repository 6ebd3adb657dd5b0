"""End-to-end checks of the native scheduler, used by ``pdflash smoke``.

Each check builds its own small scenario on a slow simulated link (memcpy
backend) or on the GPU (cuda backend), so queues really form, and decides
from completion order and ticket states, never from wall-clock thresholds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from pdflash.native import Band, Scheduler, SchedulerClosed, WaitStatus, make_key

MiB = 1 << 20


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class SmokeReport:
    backend: str
    checks: list[Check] = field(default_factory=list)
    bands: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def as_dict(self) -> dict:
        return {
            "backend": self.backend,
            "ok": self.ok,
            "checks": [c.__dict__ for c in self.checks],
            "bands": self.bands,
        }


class _Buffers:
    """Source / destination pairs; destinations live on the scheduler's device."""

    def __init__(self, backend: str, device: int):
        self.backend = backend
        self.device = torch.device("cuda", device) if backend == "cuda" else torch.device("cpu")
        self.gen = torch.Generator().manual_seed(1234)

    def pair(self, nbytes: int):
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=self.gen)
        if self.backend == "cuda":
            src = src.pin_memory()
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        return src, dst

    @staticmethod
    def same(src, dst) -> bool:
        return torch.equal(src, dst.cpu())


def _scheduler(backend: str, device: int, **kw) -> Scheduler:
    if backend == "cuda":
        kw.pop("link_gbps", None)
    return Scheduler(backend=backend, device=device, trace=64, **kw)


def _slow(backend: str) -> dict:
    # A link slow enough that queues form: 1 GB/s simulated; on a GPU the real link.
    return dict(workers=2, link_gbps=1.0, chunk_bytes=256 * 1024 if backend == "memcpy" else 4 * MiB)


def _scale(backend: str) -> int:
    """Size factor that keeps queues formed for milliseconds on a ~50 GB/s real link."""
    return 32 if backend == "cuda" else 4


def check_bytes(backend: str, device: int) -> Check:
    bufs = _Buffers(backend, device)
    sizes = [1, 7, 4096, 65537, 3 * MiB + 5, 9 * MiB]
    with _scheduler(backend, device, workers=2, chunk_bytes=MiB) as s:
        pairs = [bufs.pair(n) for n in sizes]
        tickets = [s.submit(make_key(0, i), src, dst, priority=i % 3) for i, (src, dst) in enumerate(pairs)]
        states = [s.wait(t, timeout=60) for t in tickets]
        exact = all(bufs.same(src, dst) for src, dst in pairs)
    ok = exact and all(st is WaitStatus.DONE for st in states)
    return Check("byte-exact copies", ok, f"{len(sizes)} copies of 1 B .. 9 MiB, chunked at 1 MiB")


def check_bands_order(backend: str, device: int) -> Check:
    """Work queued behind a saturated link is served band 0, then 1, then 2.

    Judged from the scheduler's own trace, not from wall-clock order: no task may start while a
    more urgent one was already submitted and had not started (workers always take the most urgent
    queued work; prefetch never takes the worker kept for on-demand). The check applies if the
    urgent tasks were submitted while the background filler still had work queued.
    """
    bufs = _Buffers(backend, device)
    k = _scale(backend)
    big = 4 * MiB * k
    with _scheduler(backend, device, **_slow(backend)) as s:
        filler = [bufs.pair(big) for _ in range(2)]
        small = {band: bufs.pair(MiB * k // 2) for band in (Band.BACKGROUND, Band.ROUTE_AHEAD, Band.ON_DEMAND)}
        fill_t = [s.submit(make_key(9, i), a, b, priority=Band.BACKGROUND) for i, (a, b) in enumerate(filler)]
        queued = {}
        for band, (src, dst) in small.items():  # submitted least urgent first
            queued[band] = (s.submit(make_key(1, int(band)), src, dst, priority=band), src, dst)
        for t in [q[0] for q in queued.values()] + fill_t:
            s.wait(t, timeout=120)
        trace = {r["ticket"]: r for r in s.drain_trace()}
        exact = all(bufs.same(src, dst) for _, src, dst in queued.values())
    recs = [trace.get(t) for t in fill_t + [q[0] for q in queued.values()]]
    if None in recs or any(r["start_s"] is None for r in recs):
        return Check("bands served in order (on-demand overtakes queued background)", False,
                     "a task is missing from the trace or never started")
    overtaken = [(a, b) for a in recs for b in recs
                 if a["priority"] < b["priority"] and a["submit_s"] < b["start_s"] < a["start_s"]]
    urgent_submitted = max(trace[queued[b][0]]["submit_s"] for b in (Band.ON_DEMAND, Band.ROUTE_AHEAD))
    applies = urgent_submitted < trace[fill_t[-1]]["end_s"]
    name = "bands served in order (on-demand overtakes queued background)"
    if not applies:
        return Check(name, exact, "not applicable: the link drained the filler before the urgent tasks were submitted")
    detail = ("no task started while a more urgent one waited; the urgent ones were submitted behind the "
              "background filler" if not overtaken else
              "started ahead of more urgent waiting work: " + ", ".join(
                  f"band {b['priority']} (key {b['key']:#x}) before band {a['priority']} (key {a['key']:#x})"
                  for a, b in overtaken))
    return Check(name, not overtaken and exact, detail)


def check_dedup(backend: str, device: int) -> Check:
    bufs = _Buffers(backend, device)
    with _scheduler(backend, device, **_slow(backend)) as s:
        k = _scale(backend)
        fill = bufs.pair(8 * MiB * k)
        src, dst = bufs.pair(2 * MiB)
        s.submit(make_key(9, 0), *fill, priority=Band.ON_DEMAND)  # keeps every worker busy
        key = make_key(2, 5)
        t1 = s.submit(key, src, dst, priority=Band.BACKGROUND)
        t2 = s.submit(key, src, dst, priority=Band.BACKGROUND)
        promote_s = time.monotonic()
        t3 = s.submit(key, src, dst, priority=Band.ON_DEMAND)  # promotes in place
        st = s.wait(t1, timeout=60)
        lv = s.stats()["levels"]
        exact = bufs.same(src, dst)
        rec = next((r for r in s.drain_trace() if r["ticket"] == t1), None)
    copied_once = lv[0]["bytes"] + lv[2]["bytes"] == 8 * MiB * k + 2 * MiB
    dedups = lv[2]["deduplicated"] + lv[0]["deduplicated"]
    promoted = lv[0]["promoted"]
    # A copy that started before the promoting submit is not promoted (it is already moving);
    # that happens when this thread is held off the CPU while the filler drains.
    started_first = rec is not None and rec["start_s"] is not None and rec["start_s"] < promote_s
    promote_ok = promoted == 1 or (started_first and promoted == 0)
    ok = t1 == t2 == t3 and st is WaitStatus.DONE and promote_ok and exact and copied_once
    detail = (f"{'one ticket' if t1 == t2 == t3 else 'distinct tickets'} for 3 submits, {dedups} deduplicated, "
              f"{promoted} promoted{' (the copy had started before the promote: not exercised)' if started_first else ''}, "
              f"status {st.name}, {'exact' if exact else 'BYTES DIFFER'}, "
              f"{'copied once' if copied_once else 'bytes copied: ' + str(lv[0]['bytes'] + lv[2]['bytes'])}")
    return Check("dedup and promote in place", ok, detail)


def check_cancel(backend: str, device: int) -> Check:
    bufs = _Buffers(backend, device)
    with _scheduler(backend, device, **_slow(backend)) as s:
        fill = bufs.pair(16 * MiB * _scale(backend))
        work = {make_key(layer, int(band)): (band, *bufs.pair(MiB)) for layer in range(4) for band in (Band.ROUTE_AHEAD, Band.BACKGROUND)}
        s.submit(make_key(9, 0), *fill, priority=Band.ON_DEMAND)  # keeps every worker busy
        pairs = {key: (s.submit(key, src, dst, priority=band), dst) for key, (band, src, dst) in work.items()}
        by_key = s.cancel(make_key(3, int(Band.ROUTE_AHEAD)))
        below = s.cancel_below_layer(2, min_priority=Band.ROUTE_AHEAD)  # layers 0, 1: 4 tasks
        band = s.cancel_band(Band.BACKGROUND)  # layers 2, 3 background: 2 tasks
        states = {k: s.wait(t, timeout=60) for k, (t, _) in pairs.items()}
        survivors = [k for k, st in states.items() if st is WaitStatus.DONE]
    ok = by_key and below == 4 and band == 2 and survivors == [make_key(2, int(Band.ROUTE_AHEAD))]
    cancelled = sum(st is WaitStatus.CANCELLED for st in states.values())
    return Check("cancel by key, band and layer", ok, f"{cancelled} of {len(states)} queued tasks cancelled")


def check_reset(backend: str, device: int) -> Check:
    bufs = _Buffers(backend, device)
    with _scheduler(backend, device, **_slow(backend)) as s:
        for i in range(20):
            src, dst = bufs.pair(MiB)
            s.submit(make_key(i, 0), src, dst, priority=Band.BACKGROUND)
            s.reset()
        src, dst = bufs.pair(3 * MiB)
        st = s.wait(s.submit(make_key(99, 0), src, dst, priority=Band.ON_DEMAND), timeout=60)
        stats = s.stats()["levels"]
        ok = st is WaitStatus.DONE and bufs.same(src, dst) and stats[0]["completed"] == 1 and stats[2]["submitted"] == 0
    return Check("reset is not terminal", ok, "20 resets with work queued, then a copy completes")


def check_close(backend: str, device: int) -> Check:
    """close() wakes every blocked waiter and is terminal.

    Decided from the scheduler's own state, not from sleeps: the waiters are known to be
    blocked (the scheduler counts them), and the check applies only if, just before
    close(), at least two filler tasks were still unclaimed in band 0, so the background
    tasks behind them cannot have been claimed (let alone landed) before shutdown began:
    every waiter must then wake with CLOSED. If the link drained the fillers first, the
    check says it was not applicable instead of guessing.
    """
    bufs = _Buffers(backend, device)
    k = _scale(backend)
    s = _scheduler(backend, device, **_slow(backend))
    fill_src, _ = bufs.pair(4 * MiB * k)
    fill_dst = [torch.zeros_like(fill_src, device=bufs.device) for _ in range(8)]  # 8 x 4k MiB of link time
    work = [bufs.pair(MiB) for _ in range(4)]
    for i, d in enumerate(fill_dst):
        s.submit(make_key(9, i), fill_src, d, priority=Band.ON_DEMAND)  # keeps every worker busy
    tickets = [s.submit(make_key(1, i), *pair, priority=Band.BACKGROUND) for i, pair in enumerate(work)]
    results: dict[int, WaitStatus] = {}
    lock = threading.Lock()

    def waiter(i, t):
        st = s.wait(t)
        with lock:
            results[i] = st

    threads = [threading.Thread(target=waiter, args=(i, t)) for i, t in enumerate(tickets)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 30
    while s.stats()["waiting"] < len(tickets) and time.monotonic() < deadline:
        time.sleep(0.0005)
    st = s.stats()
    blocked = st["waiting"]
    unclaimed_fillers = st["levels"][Band.ON_DEMAND]["queue_depth"]
    s.close()
    s.close()  # idempotent
    for th in threads:
        th.join(timeout=10)
    hung = any(th.is_alive() for th in threads)
    try:
        s.submit(make_key(1, 9), *bufs.pair(16), priority=Band.ON_DEMAND)
        refused = False
    except SchedulerClosed:
        refused = True
    statuses = ", ".join(f"waiter {i}: {results[i].name if i in results else 'still blocked'}" for i in range(len(tickets)))
    name = "close wakes waiters and is terminal"
    if blocked == len(tickets) and unclaimed_fillers < 2:
        ok = not hung and refused and len(results) == len(tickets)
        return Check(name, ok, f"not applicable: the link drained the fillers before close ({statuses}); "
                               f"waiters woke: {not hung}; later submit refused: {refused}")
    woke = len(results) == len(tickets) and all(r is WaitStatus.CLOSED for r in results.values())
    ok = blocked == len(tickets) and woke and not hung and refused
    return Check(name, ok, f"{blocked} waiters blocked, {unclaimed_fillers} fillers unclaimed at close; {statuses}; "
                           f"later submit refused: {refused}")


CHECKS = [check_bytes, check_bands_order, check_dedup, check_cancel, check_reset, check_close]


def band_activity(backend: str, device: int) -> list[dict]:
    """A short mixed workload on all three bands; returns per-band statistics with stall."""
    bufs = _Buffers(backend, device)
    with _scheduler(backend, device, **_slow(backend)) as s:
        work = []
        for i in range(6):
            for band in (Band.BACKGROUND, Band.ROUTE_AHEAD, Band.ON_DEMAND):
                src, dst = bufs.pair(MiB // 2)
                work.append(s.submit(make_key(i, int(band)), src, dst, priority=band))
        for t in reversed(work):
            s.wait(t, timeout=60)
        return s.band_stats()


def run_smoke(backend: str = "memcpy", device: int = 0) -> SmokeReport:
    report = SmokeReport(backend)
    for check in CHECKS:
        try:
            report.checks.append(check(backend, device))
        except Exception as exc:  # a check that raises has failed; report it, keep going
            report.checks.append(Check(check.__name__.removeprefix("check_"), False, f"raised {exc!r}"))
    report.bands = band_activity(backend, device)
    return report
