"""Semantics of the native scheduler through its Python wrapper (pdflash.native).

Ordering is checked through completion, never through elapsed time: one worker and a
slow simulated link make the service order deterministic, a long "blocker" task keeps
the worker busy while a scenario is queued, and several tasks writing the same region
reveal which of them was served last (its bytes are the ones left there).

The simulated link runs at 1/16 GB/s, so link time in ns is exactly 16 x bytes copied:
the link statistics then count every byte a chunk copied, and "nothing copied twice"
is an equality.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from pdflash import PdflashError
from pdflash.native import (
    NUM_PRIORITY,
    Band,
    Scheduler,
    SchedulerClosed,
    SchedulerError,
    WaitStatus,
    make_key,
    split_key,
)

CH = 4096  # chunk bytes (the wrapper's minimum): many chunks, many preemption points
SLOW = 1 / 16  # GB/s: one 4 KiB chunk is 65.5 us; link ns == 16 * bytes
NS_PER_BYTE = 16
BLOCKER = 8 << 20  # 2048 chunks, ~134 ms: keeps one worker busy while a scenario is queued


def pattern(n: int, seed: int) -> torch.Tensor:
    """n bytes, never 0 (0 marks bytes never written)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), dtype=torch.uint8, generator=g)


def slow_sched(workers: int = 1, **kw) -> Scheduler:
    return Scheduler(workers=workers, link_gbps=SLOW, chunk_bytes=CH, **kw)


class Blocker:
    """A long on-demand task that holds the only worker until it is cancelled."""

    def __init__(self, s: Scheduler, layer: int = 900, size: int = BLOCKER):
        self.s = s
        self.key = make_key(layer, 0)
        self.src = pattern(size, 99)
        self.dst = torch.zeros(size, dtype=torch.uint8)
        self.ticket = s.submit(self.key, self.src, self.dst, priority=Band.ON_DEMAND)
        wait_started(s)

    def still_running(self) -> bool:
        return self.s.query(self.ticket) is WaitStatus.PENDING

    def release(self) -> int:
        """Cancel the blocker; returns the bytes it copied (a chunk-aligned prefix)."""
        assert self.s.cancel(self.key)
        assert self.s.wait(self.ticket) is WaitStatus.CANCELLED
        return landed_prefix(self.src, self.dst)


def landed_prefix(src: torch.Tensor, dst: torch.Tensor) -> int:
    """Length of the prefix of dst equal to src; asserts every byte after it is untouched."""
    diff = (src != dst).nonzero()
    k = int(diff[0]) if len(diff) else len(src)
    assert not dst[k:].any(), "bytes written after the copied prefix"
    return k


def wait_started(s: Scheduler) -> None:
    """Until a worker has claimed a first chunk (fresh workers take a moment to run)."""
    while s.stats()["chunks"] == 0:
        threading.Event().wait(0.0005)


def level(s: Scheduler, p: int) -> dict:
    return s.stats()["levels"][int(p)]


def totals(s: Scheduler) -> dict:
    st = s.stats()
    out = {k: sum(lv[k] for lv in st["levels"]) for k in st["levels"][0] if k != "priority" and not k.endswith("_s")}
    out["chunks"] = st["chunks"]
    out["link_bytes"] = round(st["link_busy_s"] * 1e9) // NS_PER_BYTE
    return out


# ---- exports and keys -----------------------------------------------------------------------
def test_bands_and_levels_are_exported():
    assert NUM_PRIORITY == 20
    assert (Band.ON_DEMAND, Band.ROUTE_AHEAD, Band.BACKGROUND) == (0, 1, 2)
    assert issubclass(SchedulerClosed, SchedulerError) and issubclass(SchedulerError, PdflashError)


def test_make_key_roundtrip_and_range():
    for layer, expert in ((0, 0), (3, 7), (2**32 - 1, 2**32 - 1), (1, 2**31)):
        key = make_key(layer, expert)
        assert 0 <= key < 2**64 and split_key(key) == (layer, expert)
    assert make_key(1, 0) > make_key(0, 2**32 - 1)  # the layer is the high half
    for bad in ((-1, 0), (0, -1), (2**32, 0), (0, 2**32)):
        with pytest.raises(SchedulerError):
            make_key(*bad)


# ---- byte-exact copies ---------------------------------------------------------------------
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("nbytes", [1, 17, CH - 1, CH, CH + 1, 5 * CH + 123, 64 * CH])
def test_torch_copies_are_byte_exact(workers, nbytes):
    src = pattern(nbytes, nbytes)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    with Scheduler(workers=workers, chunk_bytes=CH) as s:
        assert s.wait(s.submit(make_key(1, 1), src, dst)) is WaitStatus.DONE
        assert totals(s)["chunks"] == -(-nbytes // CH)
    assert torch.equal(src, dst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16])
def test_typed_tensors_copy_their_bytes(dtype):
    src = torch.randn(3000, generator=torch.Generator().manual_seed(1)).mul(1000).to(dtype)
    dst = torch.zeros_like(src)
    with Scheduler(chunk_bytes=CH) as s:
        assert s.wait(s.submit(make_key(2, 2), src, dst, priority=Band.ROUTE_AHEAD)) is WaitStatus.DONE
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))


def test_buffers_numpy_and_raw_addresses():
    data = bytes(pattern(10_000, 5).tolist())
    with Scheduler(chunk_bytes=CH) as s:
        # bytes (read-only) -> bytearray
        ba = bytearray(len(data))
        assert s.wait(s.submit(1, data, ba)) is WaitStatus.DONE
        assert bytes(ba) == data
        # numpy -> numpy, other dtype
        a = np.frombuffer(data, dtype=np.uint8).view(np.int16).copy()
        b = np.zeros_like(a)
        assert s.wait(s.submit(2, a, b)) is WaitStatus.DONE
        assert np.array_equal(a, b)
        # raw addresses (ctypes) with nbytes
        csrc = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        cdst = (ctypes.c_ubyte * len(data))()
        assert s.wait(s.submit(3, ctypes.addressof(csrc), ctypes.addressof(cdst), nbytes=len(data))) is WaitStatus.DONE
        assert bytes(cdst) == data
        # mixed kinds: torch -> numpy, numpy -> memoryview slice of a bytearray
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        n = np.zeros(len(data), dtype=np.uint8)
        assert s.wait(s.submit(4, t, n)) is WaitStatus.DONE
        assert n.tobytes() == data
        big = bytearray(3 * len(data))
        assert s.wait(s.submit(5, n, memoryview(big)[len(data):2 * len(data)])) is WaitStatus.DONE
        assert bytes(big[len(data):2 * len(data)]) == data and not any(big[:len(data)]) and not any(big[2 * len(data):])


def test_partial_nbytes_copies_only_the_prefix():
    src = pattern(3 * CH, 8)
    dst = torch.zeros(4 * CH, dtype=torch.uint8)
    with Scheduler(chunk_bytes=CH) as s:
        assert s.wait(s.submit(9, src, dst, nbytes=2 * CH + 5)) is WaitStatus.DONE
    assert torch.equal(dst[:2 * CH + 5], src[:2 * CH + 5]) and not dst[2 * CH + 5:].any()


def test_temporary_source_is_kept_alive_until_the_copy_ends():
    with slow_sched() as s:
        b = Blocker(s)
        dst = torch.zeros(3 * CH, dtype=torch.uint8)
        src = pattern(3 * CH, 42)
        expect = src.clone()
        ref = weakref.ref(src)
        t = s.submit(make_key(1, 1), src, dst)
        del src  # the last reference here: without the scheduler's, the tensor is freed now
        assert ref() is not None, "the scheduler must hold the source while the task is live"
        assert b.still_running()
        b.release()
        assert s.wait(t) is WaitStatus.DONE
        assert torch.equal(dst, expect)
        gc.collect()
        assert ref() is None, "the source is released once its ticket has ended"


# ---- caller mistakes ------------------------------------------------------------------------
def test_invalid_configurations_raise():
    for kw in (dict(backend="nope"), dict(workers=0), dict(workers=1000), dict(chunk_bytes=100),
               dict(link_gbps=0), dict(link_gbps=-1), dict(latency_us=-1)):
        with pytest.raises(SchedulerError):
            Scheduler(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when no GPU is usable")
def test_cuda_backend_without_a_gpu_raises_a_clear_error():
    with pytest.raises(SchedulerError, match="cuda"):
        Scheduler(backend="cuda")


def test_invalid_submits_raise():
    src = pattern(100, 1)
    with Scheduler() as s:
        bad = [
            dict(priority=-1), dict(priority=NUM_PRIORITY), dict(nbytes=0), dict(nbytes=-5),
            dict(nbytes=101),  # larger than both buffers
        ]
        for kw in bad:
            with pytest.raises(SchedulerError):
                s.submit(1, src, torch.zeros(100, dtype=torch.uint8), **kw)
        with pytest.raises(SchedulerError, match="dst holds 50"):
            s.submit(1, src, torch.zeros(50, dtype=torch.uint8))
        with pytest.raises(SchedulerError, match="nbytes is required"):
            s.submit(1, src.data_ptr(), torch.zeros(100, dtype=torch.uint8))
        with pytest.raises(SchedulerError):
            s.submit(1, 0, torch.zeros(100, dtype=torch.uint8), nbytes=10)
        with pytest.raises(SchedulerError, match="contiguous"):
            s.submit(1, torch.arange(100, dtype=torch.uint8)[::2], torch.zeros(50, dtype=torch.uint8))
        with pytest.raises(SchedulerError, match="host memory"):  # wrong device for this backend
            s.submit(1, torch.empty(100, dtype=torch.uint8, device="meta"), torch.zeros(100, dtype=torch.uint8))
        with pytest.raises(SchedulerError, match="host memory"):
            s.submit(1, src, torch.empty(100, dtype=torch.uint8, device="meta"))
        with pytest.raises(SchedulerError):
            s.submit(1, [1, 2, 3], bytearray(3))
        for key in (-1, 2**64):
            with pytest.raises(SchedulerError):
                s.submit(key, src, torch.zeros(100, dtype=torch.uint8))
        for call in (lambda: s.promote(1, NUM_PRIORITY), lambda: s.cancel_band(-1),
                     lambda: s.cancel_below_layer(3, min_priority=99), lambda: s.cancel_below_layer(-1),
                     lambda: s.wait(10**9), lambda: s.query(10**9)):
            with pytest.raises(SchedulerError):
                call()
        # nothing above reached the queues
        assert totals(s)["submitted"] == 0


def test_unsupported_buffers_raise_scheduler_error():
    with Scheduler() as s:
        with pytest.raises(SchedulerError):  # not C-contiguous: ffi.from_buffer raises ValueError
            s.submit(1, np.arange(20, dtype=np.uint8)[::2], np.zeros(10, dtype=np.uint8))
        with pytest.raises(SchedulerError):  # read-only destination: BufferError
            s.submit(2, b"abc", b"xyz")


def test_same_key_with_other_buffers_while_live_conflicts():
    with slow_sched() as s:
        b = Blocker(s)
        src, dst = pattern(CH, 1), torch.zeros(CH, dtype=torch.uint8)
        t = s.submit(make_key(1, 1), src, dst)
        with pytest.raises(SchedulerError, match="another source"):
            s.submit(make_key(1, 1), src, torch.zeros(CH, dtype=torch.uint8))
        with pytest.raises(SchedulerError, match="another source"):
            s.submit(make_key(1, 1), src, dst, nbytes=CH - 1)
        b.release()
        assert s.wait(t) is WaitStatus.DONE and torch.equal(src, dst)


# ---- priorities and overtaking -------------------------------------------------------------
def test_levels_are_served_most_urgent_first():
    """Pairs of tasks write one region each, the less urgent one submitted first: with
    priority order the less urgent one lands last and its bytes remain; FIFO would leave
    the other's."""
    pairs = [(0, 1), (1, 2), (0, 2), (2, 3), (5, 19), (18, 19)]
    with slow_sched() as s:
        b = Blocker(s)
        regions, srcs, tickets = [], [], []
        for i, (hi, lo) in enumerate(pairs):
            region = torch.zeros(2 * CH + 7, dtype=torch.uint8)
            for p in (lo, hi):  # least urgent first
                src = pattern(len(region), 1000 * i + p)
                srcs.append(src)
                tickets.append(s.submit(make_key(10 + i, p), src, region, priority=p))
            regions.append(region)
        assert b.still_running(), "precondition: everything was queued behind the blocker"
        assert level(s, 0)["queue_depth"] == 1 + sum(hi == 0 for hi, _ in pairs)  # the blocker too
        b.release()
        assert all(s.wait(t) is WaitStatus.DONE for t in tickets)
        for i, region in enumerate(regions):
            assert torch.equal(region, srcs[2 * i]), f"pair {pairs[i]}: the less urgent task did not land last"


@pytest.mark.parametrize("workers", [1, 2])
def test_on_demand_overtakes_queued_and_in_flight_background(workers):
    """A large background copy is in flight and another is queued behind it; an on-demand
    task finishes while both are still pending, then both complete exactly, and every
    byte crossed the link once."""
    with slow_sched(workers=workers) as s:
        a_src, a_dst = pattern(BLOCKER, 1), torch.zeros(BLOCKER, dtype=torch.uint8)
        b_src, b_dst = pattern(CH, 2), torch.zeros(CH, dtype=torch.uint8)
        o_src, o_dst = pattern(2 * CH, 3), torch.zeros(2 * CH, dtype=torch.uint8)
        ta = s.submit(make_key(1, 1), a_src, a_dst, priority=Band.BACKGROUND)
        tb = s.submit(make_key(1, 2), b_src, b_dst, priority=Band.BACKGROUND)
        to = s.submit(make_key(1, 3), o_src, o_dst, priority=Band.ON_DEMAND)
        assert s.wait(to) is WaitStatus.DONE
        b_untouched = not b_dst.any()
        a_pending, b_pending = s.query(ta) is WaitStatus.PENDING, s.query(tb) is WaitStatus.PENDING
        assert torch.equal(o_src, o_dst)
        assert a_pending and b_pending and b_untouched
        s.cancel(make_key(1, 1))  # end the long copy early; it stops at a chunk boundary
        assert s.wait(ta) is WaitStatus.CANCELLED and s.wait(tb) is WaitStatus.DONE
        k = landed_prefix(a_src, a_dst)
        assert 0 < k < BLOCKER and k % CH == 0
        assert torch.equal(b_src, b_dst)
        t = totals(s)
        assert t["link_bytes"] == k + CH + 2 * CH  # nothing copied twice
        assert t["chunks"] == k // CH + 1 + 2


def test_prefetch_never_takes_the_last_worker():
    """Background work may use at most workers-1 workers, so one stays free for on-demand."""
    with slow_sched(workers=3) as s:
        srcs = [pattern(BLOCKER // 4, i) for i in range(4)]
        dsts = [torch.zeros(BLOCKER // 4, dtype=torch.uint8) for _ in range(4)]
        for i in range(4):
            s.submit(make_key(1, i), srcs[i], dsts[i], priority=Band.BACKGROUND)
        wait_started(s)
        seen = 0
        for _ in range(50):  # sample while the background queue drains
            in_flight = sum(lv["in_flight"] for lv in s.stats()["levels"][1:])
            assert in_flight <= 2
            seen = max(seen, in_flight)
        assert seen >= 1
        o_src, o_dst = pattern(CH, 9), torch.zeros(CH, dtype=torch.uint8)
        assert s.wait(s.submit(make_key(2, 0), o_src, o_dst, priority=Band.ON_DEMAND)) is WaitStatus.DONE
        assert torch.equal(o_src, o_dst)
        assert level(s, Band.BACKGROUND)["queue_depth"] >= 1  # it overtook queued work
        assert s.cancel_band(Band.BACKGROUND) >= 1


# ---- dedup and promote -------------------------------------------------------------------------
def test_dedup_returns_the_same_ticket_and_promotes_in_place():
    with slow_sched() as s:
        b = Blocker(s)
        region = torch.zeros(3 * CH, dtype=torch.uint8)
        x_src, t_src = pattern(len(region), 1), pattern(len(region), 2)
        tx = s.submit(make_key(5, 1), x_src, region, priority=Band.BACKGROUND)
        tt = s.submit(make_key(5, 2), t_src, region, priority=Band.BACKGROUND)
        assert s.submit(make_key(5, 2), t_src, region, priority=Band.BACKGROUND) == tt  # plain dedup
        assert s.submit(make_key(5, 2), t_src, region, priority=7) == tt  # less urgent: stays at 2
        assert s.submit(make_key(5, 2), t_src, region, priority=Band.ON_DEMAND) == tt  # promoted in place
        assert level(s, Band.BACKGROUND)["queue_depth"] == 1 and level(s, 0)["queue_depth"] == 2
        assert b.still_running()
        b.release()
        assert s.wait(tx) is WaitStatus.DONE and s.wait(tt) is WaitStatus.DONE
        assert torch.equal(region, x_src), "the promoted task must be served before the earlier background one"
        lv = s.stats()["levels"]
        assert lv[2]["submitted"] == 2 and lv[2]["deduplicated"] == 1 and lv[7]["deduplicated"] == 1
        assert lv[0]["deduplicated"] == 1 and lv[0]["promoted"] == 1
        assert lv[0]["completed"] == 1 and lv[2]["completed"] == 1  # counted where each task ended
        t = totals(s)
        assert t["submitted"] == 3 and t["completed"] == 2 and t["cancelled"] == 1  # the blocker
        # the key ended: the same submit now starts a new task (a new ticket, a second copy)
        t2 = s.submit(make_key(5, 2), t_src, region, priority=Band.BACKGROUND)
        assert t2 != tt and s.wait(t2) is WaitStatus.DONE and torch.equal(region, t_src)


def test_promote_moves_a_queued_task_ahead():
    with slow_sched() as s:
        b = Blocker(s)
        region = torch.zeros(CH, dtype=torch.uint8)
        srcs = [pattern(CH, i) for i in range(3)]
        tickets = [s.submit(make_key(6, i), srcs[i], region, priority=Band.BACKGROUND) for i in range(3)]
        assert s.promote(make_key(6, 2), Band.ROUTE_AHEAD) is True
        assert s.promote(make_key(6, 2), Band.ROUTE_AHEAD) is False  # already there
        assert s.promote(make_key(6, 2), Band.BACKGROUND) is False  # never demotes
        assert s.promote(make_key(6, 99), Band.ON_DEMAND) is False  # unknown key
        assert b.still_running()
        b.release()
        assert all(s.wait(t) is WaitStatus.DONE for t in tickets)
        assert torch.equal(region, srcs[1]), "served order must be 2 (promoted), 0, 1"
        assert level(s, Band.ROUTE_AHEAD)["promoted"] == 1 and level(s, Band.ROUTE_AHEAD)["completed"] == 1
        assert s.promote(make_key(6, 0), Band.ON_DEMAND) is False  # ended tasks are not live


# ---- cancellation --------------------------------------------------------------------------
def test_cancel_by_key_stops_a_queued_task_and_wakes_its_waiters():
    with slow_sched() as s:
        b = Blocker(s)
        src, dst = pattern(5 * CH, 1), torch.zeros(5 * CH, dtype=torch.uint8)
        t = s.submit(make_key(7, 1), src, dst, priority=Band.ROUTE_AHEAD)
        results, started = [], threading.Barrier(4)

        def waiter():
            started.wait()
            results.append(s.wait(t))

        threads = [threading.Thread(target=waiter) for _ in range(3)]
        for th in threads:
            th.start()
        started.wait()
        assert s.cancel(make_key(7, 1)) is True
        for th in threads:
            th.join(timeout=30)
        assert results == [WaitStatus.CANCELLED] * 3
        assert s.cancel(make_key(7, 1)) is False and s.cancel(make_key(7, 2)) is False
        assert s.query(t) is WaitStatus.CANCELLED and s.wait(t) is WaitStatus.CANCELLED
        b.release()
        assert not dst.any(), "a cancelled task that never started writes nothing"
        lv = level(s, Band.ROUTE_AHEAD)
        assert lv["cancelled"] == 1 and lv["completed"] == 0 and lv["queue_depth"] == 0


def test_cancel_in_flight_stops_at_a_chunk_boundary_and_resubmit_revives():
    with slow_sched() as s:
        src, dst = pattern(BLOCKER, 3), torch.zeros(BLOCKER, dtype=torch.uint8)
        key = make_key(8, 1)
        t = s.submit(key, src, dst, priority=Band.BACKGROUND)
        wait_started(s)
        assert s.cancel(key) is True
        assert s.wait(t) is WaitStatus.CANCELLED
        k = landed_prefix(src, dst)
        assert 0 < k < BLOCKER and k % CH == 0
        assert totals(s)["link_bytes"] == k

    # cancel, then submit the same key again before the chunk in flight lands (1 MiB
    # chunks: ~17 ms each): the task is revived under its ticket, the landed part is not
    # copied again, and the ticket ends done
    big = 1 << 20
    with Scheduler(workers=1, link_gbps=SLOW, chunk_bytes=big) as s:
        src2, dst2 = pattern(BLOCKER, 4), torch.zeros(BLOCKER, dtype=torch.uint8)
        key2 = make_key(8, 2)
        t2 = s.submit(key2, src2, dst2, priority=Band.BACKGROUND)
        wait_started(s)
        assert s.cancel(key2) is True
        assert s.query(t2) is WaitStatus.PENDING  # its first chunk is still landing
        assert s.submit(key2, src2, dst2, priority=Band.ROUTE_AHEAD) == t2
        assert s.wait(t2) is WaitStatus.DONE and torch.equal(src2, dst2)
        tot = totals(s)
        assert tot["link_bytes"] == BLOCKER and tot["chunks"] == BLOCKER // big
        assert tot["cancelled"] == 0 and tot["completed"] == 1 and tot["deduplicated"] == 1


def test_cancel_band_cancels_only_that_level():
    with slow_sched() as s:
        b = Blocker(s)
        tasks = {}
        for p in (Band.ROUTE_AHEAD, Band.BACKGROUND, 7):
            for i in range(3):
                src, dst = pattern(CH, 10 * p + i), torch.zeros(CH, dtype=torch.uint8)
                tasks[(p, i)] = (s.submit(make_key(20 + i, p), src, dst, priority=p), src, dst)
        assert s.cancel_band(Band.BACKGROUND) == 3
        assert s.cancel_band(Band.BACKGROUND) == 0
        assert s.cancel_band(11) == 0
        b.release()
        for (p, _), (t, src, dst) in tasks.items():
            if p == Band.BACKGROUND:
                assert s.wait(t) is WaitStatus.CANCELLED and not dst.any()
            else:
                assert s.wait(t) is WaitStatus.DONE and torch.equal(src, dst)


@pytest.mark.parametrize("min_priority", [0, Band.ROUTE_AHEAD, Band.BACKGROUND])
def test_cancel_below_layer_drops_stale_prefetch(min_priority):
    with slow_sched() as s:
        b = Blocker(s, layer=900)  # its layer is above every threshold: never stale
        tasks = {}
        for layer in range(5):
            for p in (Band.ON_DEMAND, Band.ROUTE_AHEAD, Band.BACKGROUND):
                src, dst = pattern(CH, 10 * layer + p), torch.zeros(CH, dtype=torch.uint8)
                tasks[(layer, p)] = (s.submit(make_key(layer, p), src, dst, priority=p), src, dst)
        want = {k for k in tasks if k[0] < 3 and k[1] >= min_priority}
        assert s.cancel_below_layer(3, min_priority=min_priority) == len(want)
        assert s.cancel_below_layer(3, min_priority=min_priority) == 0
        assert s.cancel_below_layer(0) == 0
        assert b.still_running()
        b.release()
        for k, (t, src, dst) in tasks.items():
            if k in want:
                assert s.wait(t) is WaitStatus.CANCELLED and not dst.any(), k
            else:
                assert s.wait(t) is WaitStatus.DONE and torch.equal(src, dst), k


# ---- wait and query -----------------------------------------------------------------------
def test_wait_timeout_query_and_repeated_waits():
    with slow_sched() as s:
        b = Blocker(s)
        src, dst = pattern(CH, 1), torch.zeros(CH, dtype=torch.uint8)
        t = s.submit(make_key(1, 1), src, dst)
        assert s.query(t) is WaitStatus.PENDING
        assert s.wait(t, timeout=0) is WaitStatus.TIMEOUT
        assert s.wait(t, timeout=0.01) is WaitStatus.TIMEOUT
        b.release()
        assert s.wait(t, timeout=float("inf")) is WaitStatus.DONE
        assert s.wait(t) is WaitStatus.DONE and s.wait(t, timeout=0) is WaitStatus.DONE
        assert s.query(t) is WaitStatus.DONE
        assert torch.equal(src, dst)


def test_long_ended_tickets_expire_from_a_small_history():
    src = pattern(64, 1)
    with Scheduler(history=4) as s:
        tickets = []
        for i in range(12):
            tickets.append(s.submit(i, src, torch.zeros(64, dtype=torch.uint8)))
            assert s.wait(tickets[-1]) is WaitStatus.DONE
        assert all(s.wait(t) is WaitStatus.EXPIRED for t in tickets[:8])
        assert all(s.query(t) is WaitStatus.EXPIRED for t in tickets[:8])
        assert all(s.wait(t) is WaitStatus.DONE for t in tickets[8:])


# ---- reset ------------------------------------------------------------------------------------
def test_reset_cancels_queued_work_zeroes_stats_and_keeps_running():
    with slow_sched() as s:
        b = Blocker(s)
        queued = []
        for i in range(6):
            src, dst = pattern(2 * CH, i), torch.zeros(2 * CH, dtype=torch.uint8)
            queued.append((s.submit(make_key(3, i), src, dst, priority=i % 3), src, dst))
        results = []
        waiters = [threading.Thread(target=lambda t=t: results.append(s.wait(t))) for t, _, _ in queued[:3]]
        for th in waiters:
            th.start()
        s.reset()
        for th in waiters:
            th.join(timeout=30)
        assert results == [WaitStatus.CANCELLED] * 3
        assert s.query(b.ticket) is WaitStatus.CANCELLED  # in flight: its last chunk landed first
        landed_prefix(b.src, b.dst)
        for t, _, dst in queued:
            assert s.wait(t) is WaitStatus.CANCELLED and not dst.any()
        st = s.stats()
        assert st["chunks"] == 0 and st["link_busy_s"] == 0
        for lv in st["levels"]:
            # a waiter woken by the reset may reacquire the lock after the counters were
            # zeroed: it adds only that last moment of its stall and does not count itself
            rest = {k: v for k, v in lv.items() if v and k not in ("priority", "stall_ns", "stall_s")}
            assert not rest, rest
            assert lv["stall_s"] < st["elapsed_s"]
        # usable at once, and the statistics count from zero
        src, dst = pattern(3 * CH, 77), torch.zeros(3 * CH, dtype=torch.uint8)
        assert s.wait(s.submit(make_key(3, 0), src, dst)) is WaitStatus.DONE and torch.equal(src, dst)
        t = totals(s)
        assert t["submitted"] == 1 and t["completed"] == 1 and t["bytes"] == 3 * CH and t["link_bytes"] == 3 * CH


def test_a_hundred_resets_in_a_row():
    with Scheduler(workers=2, chunk_bytes=CH, link_gbps=1.0) as s:
        src = pattern(16 * CH, 1)
        dsts = [torch.zeros(16 * CH, dtype=torch.uint8) for _ in range(4)]
        for r in range(100):
            tickets = [s.submit(make_key(r, i), src, dsts[i], priority=i % 3) for i in range(4)]
            s.reset()
            for t in tickets:  # ended one way or the other, and reset left nothing live
                assert s.query(t) in (WaitStatus.DONE, WaitStatus.CANCELLED)
        assert totals(s)["queue_depth"] == 0
        dst = torch.zeros_like(src)
        assert s.wait(s.submit(make_key(999, 0), src, dst)) is WaitStatus.DONE and torch.equal(src, dst)


# ---- close --------------------------------------------------------------------------------------
def test_close_is_terminal_idempotent_and_wakes_blocked_waiters():
    s = slow_sched(workers=2)
    b = Blocker(s, size=8 * BLOCKER)  # ~1 s: outlasts the set-up below even on a loaded machine
    tickets = [s.submit(make_key(4, i), pattern(CH, i), torch.zeros(CH, dtype=torch.uint8), priority=i % 3)
               for i in range(5)]
    results, ready = [], threading.Barrier(len(tickets) + 2)

    def waiter(t):
        ready.wait()
        results.append(s.wait(t))

    threads = [threading.Thread(target=waiter, args=(t,)) for t in tickets + [b.ticket]]
    for th in threads:
        th.start()
    ready.wait()
    deadline = time.monotonic() + 10
    while s._active < len(threads) and time.monotonic() < deadline:  # every waiter inside its wait call
        threading.Event().wait(0.001)
    assert s._active == len(threads), "a waiter returned before close (the blocker ended early)"
    threading.Event().wait(0.05)  # ... and blocked in C
    assert b.still_running()
    s.close()
    for th in threads:
        th.join(timeout=30)
    assert not any(th.is_alive() for th in threads)
    assert results == [WaitStatus.CLOSED] * len(threads)
    assert s.closed
    s.close()  # idempotent
    calls = {
        "submit": lambda: s.submit(1, b"x", bytearray(1)),
        "wait": lambda: s.wait(tickets[0]),
        "query": lambda: s.query(tickets[0]),
        "promote": lambda: s.promote(1, 0),
        "cancel": lambda: s.cancel(1),
        "cancel_band": lambda: s.cancel_band(2),
        "cancel_below_layer": lambda: s.cancel_below_layer(3),
        "reset": s.reset,
        "stats": s.stats,
        "band_stats": s.band_stats,
        "ticket_error": lambda: s.ticket_error(tickets[0]),
    }
    for name, call in calls.items():
        with pytest.raises(SchedulerClosed):
            call()


def test_context_manager_closes_and_close_during_reset_returns():
    with slow_sched() as s:
        Blocker(s)
        out = []

        def resetter():
            try:
                s.reset()
                out.append("reset")
            except SchedulerClosed:
                out.append("closed")

        th = threading.Thread(target=resetter)
        th.start()
    th.join(timeout=30)
    assert s.closed and not th.is_alive() and out in (["reset"], ["closed"])


# ---- statistics ----------------------------------------------------------------------------
def test_statistics_count_every_event_where_it_happened():
    with slow_sched() as s:
        b = Blocker(s)
        sizes = [CH, 3 * CH + 5, 2 * CH]
        srcs = [pattern(n, i) for i, n in enumerate(sizes)]
        dsts = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        ts = [s.submit(make_key(1, i), srcs[i], dsts[i], priority=Band.BACKGROUND) for i in range(3)]
        s.submit(make_key(1, 0), srcs[0], dsts[0], priority=Band.BACKGROUND)  # dedup at 2
        s.submit(make_key(1, 1), srcs[1], dsts[1], priority=Band.ROUTE_AHEAD)  # dedup + promote to 1
        assert s.promote(make_key(1, 2), Band.ROUTE_AHEAD)
        lv = s.stats()["levels"]
        assert (lv[0]["queue_depth"], lv[1]["queue_depth"], lv[2]["queue_depth"]) == (1, 2, 1)
        assert lv[0]["in_flight"] == 1 and lv[1]["in_flight"] == 0
        # stall goes to the level of the task waited on
        assert s.wait(ts[0], timeout=0.02) is WaitStatus.TIMEOUT
        lv = s.stats()["levels"]
        assert lv[2]["stall_waits"] == 1 and lv[2]["stall_s"] > 0
        assert lv[0]["stall_waits"] == lv[1]["stall_waits"] == 0
        assert s.cancel(make_key(1, 2))
        b.release()
        assert [s.wait(t) for t in ts] == [WaitStatus.DONE, WaitStatus.DONE, WaitStatus.CANCELLED]
        assert s.wait(ts[0]) is WaitStatus.DONE  # already ended: not a stall
        st = s.stats()
        lv = st["levels"]
        assert lv[2]["submitted"] == 3 and lv[2]["deduplicated"] == 1 and lv[2]["completed"] == 1
        assert lv[2]["bytes"] == sizes[0]
        assert lv[1]["deduplicated"] == 1 and lv[1]["promoted"] == 2
        assert lv[1]["completed"] == 1 and lv[1]["cancelled"] == 1 and lv[1]["bytes"] == sizes[1]
        assert lv[0]["submitted"] == 1 and lv[0]["cancelled"] == 1
        assert all(x["queue_depth"] == 0 and x["in_flight"] == 0 and x["failed"] == 0 for x in lv)
        # every completed task waited behind the blocker: a queue wait was recorded for it
        for p in (1, 2):
            assert lv[p]["queue_wait_s"] > 0 and 0 < lv[p]["max_queue_wait_s"] <= lv[p]["queue_wait_s"]
            assert lv[p]["transfer_s"] > 0
        k = landed_prefix(b.src, b.dst)
        assert st["chunks"] == k // CH + 1 + 4
        assert round(st["link_busy_s"] * 1e9) == NS_PER_BYTE * (k + sizes[0] + sizes[1])
        assert st["elapsed_s"] > 0 and st["backend"] == "memcpy" and st["workers"] == 1
        bands = s.band_stats()
        assert [x["name"] for x in bands] == ["on-demand", "route-ahead", "background"]
        assert [x["completed"] for x in bands] == [0, 1, 1]
        assert torch.equal(srcs[0], dsts[0]) and torch.equal(srcs[1], dsts[1]) and not dsts[2].any()


def test_wait_releases_the_gil():
    with slow_sched() as s:
        b = Blocker(s)
        t = s.submit(make_key(1, 1), pattern(CH, 1), torch.zeros(CH, dtype=torch.uint8))
        entered, out = threading.Event(), []

        def waiter():
            entered.set()
            out.append(s.wait(t, timeout=20))

        th = threading.Thread(target=waiter)
        th.start()
        entered.wait()
        # Python keeps running here while the waiter is blocked in C; if the wait held the
        # GIL, this thread would only get here after the 20 s timeout.
        n = sum(i for i in range(200_000))
        assert n and th.is_alive()
        assert s.cancel(make_key(1, 1))
        th.join(timeout=30)
        assert out == [WaitStatus.CANCELLED]
        b.release()
