"""Failure and in-flight paths of the scheduler, driven on the memcpy backend.

An asynchronous copy (the cuda backend) keeps writing after a waiter could have
returned, and a copy can fail. The memcpy backend emulates both: ``paced`` writes
each chunk in slices across its simulated link time, ``fault_every`` makes every
Nth chunk fail after writing half of it (``fault_max`` bounds how many). The
checks follow the scheduler's own state (tickets, statistics, error text); the
slow links only make the windows wide.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from pdflash.native import Band, Scheduler, WaitStatus, make_key

KiB = 1024


def _until(cond, what: str, deadline_s: float = 20.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.002)


def test_buffers_stay_referenced_after_a_closed_wait_until_close_has_joined():
    # one 1 MiB chunk over a 0.5 MB/s link: it is still being written ~2 s after submit,
    # so close() (joining the worker) outlasts the waiter's look by a wide margin
    n = 1 << 20
    s = Scheduler(workers=1, chunk_bytes=n, link_gbps=0.0005, paced=True)
    base = torch.zeros(2 * n, dtype=torch.uint8)  # owns the memory, so nothing is freed under the copy
    src = torch.randint(1, 256, (n,), dtype=torch.uint8)
    dst = base[:n]  # the view the scheduler is given; only it holds this object
    ref = weakref.ref(dst)
    t = s.submit(make_key(0, 1), src, dst, priority=Band.ON_DEMAND)
    del dst
    seen: dict = {}
    closer = threading.Thread(target=s.close)

    def waiter():
        seen["status"] = s.wait(t)
        seen["alive"] = ref() is not None  # no cycles: a dropped reference frees it at once
        seen["close_running"] = closer.is_alive()  # so the look above happened before close() returned
        seen["written_at_wake"] = int((base[:n] != 0).sum())

    th = threading.Thread(target=waiter)
    th.start()
    _until(lambda: s.stats()["waiting"] == 1, "the waiter blocks")
    # the chunk is being written as we close (the worker claims it within a few ms; on a loaded
    # machine that can be after the waiter blocks)
    _until(lambda: s.stats()["levels"][0]["in_flight"] == 1, "the chunk is on its way")
    closer.start()
    th.join(timeout=30)
    closer.join(timeout=30)
    assert not th.is_alive() and not closer.is_alive()
    assert seen["status"] is WaitStatus.CLOSED
    assert seen["close_running"], "close() returned before the waiter looked: the check could not apply"
    assert seen["alive"], "the destination was released while its chunk was still landing"
    # the paced copy went on writing after the waiter woke; close() waited for it
    assert int((base[:n] != 0).sum()) > seen["written_at_wake"]
    gc.collect()
    assert ref() is None  # close() released it


def test_a_chunk_failing_while_its_task_is_cancelled_fails_the_task_and_a_resubmit_starts_clean():
    # three workers take chunks 1-3 at once; the shared 0.25 MB/s link lands them ~0.25 s apart.
    # Chunk 2 fails (fault_every=2, once). The task is cancelled while all three are out.
    n, ch = 4 * 64 * KiB, 64 * KiB
    s = Scheduler(workers=3, chunk_bytes=ch, link_gbps=0.00025, paced=True, fault_every=2, fault_max=1)
    try:
        key = make_key(2, 3)
        src = torch.randint(1, 256, (n,), dtype=torch.uint8)
        dst = torch.zeros(n, dtype=torch.uint8)
        t1 = s.submit(key, src, dst, priority=Band.ON_DEMAND)
        _until(lambda: s.stats()["chunks"] == 3, "three chunks are claimed")
        assert s.cancel(key)  # chunk 4 is still queued: the task is cancelled with 3 chunks out
        _until(lambda: s.ticket_error(t1) != "", "the failed chunk is recorded although the task was cancelled")
        assert "injected copy failure" in s.ticket_error(t1)
        # chunk 3 is still landing: a resubmit now gets the failing ticket, never a revival
        assert s.submit(key, src, dst, priority=Band.ON_DEMAND) == t1
        assert s.wait(t1, timeout=30) is WaitStatus.FAILED
        t2 = s.submit(key, src, dst, priority=Band.ON_DEMAND)  # ended: a new task from byte 0
        assert t2 != t1
        assert s.wait(t2, timeout=30) is WaitStatus.DONE
        assert torch.equal(src, dst)  # the new task copied every byte, the failed half-chunk included
        lv = s.stats()["levels"][0]
        assert lv["failed"] == 1 and lv["completed"] == 1 and lv["cancelled"] == 0
    finally:
        s.close()


def test_injected_failures_fail_their_tickets_with_the_reason_and_others_complete():
    s = Scheduler(workers=2, chunk_bytes=4 * KiB, fault_every=3)
    try:
        pairs = [(torch.randint(1, 256, (4 * KiB,), dtype=torch.uint8), torch.zeros(4 * KiB, dtype=torch.uint8))
                 for _ in range(12)]
        tickets = [s.submit(make_key(0, i), a, b, priority=Band.BACKGROUND) for i, (a, b) in enumerate(pairs)]
        states = [s.wait(t, timeout=30) for t in tickets]
        failed = [i for i, st in enumerate(states) if st is WaitStatus.FAILED]
        assert len(failed) == 4 and all(st in (WaitStatus.DONE, WaitStatus.FAILED) for st in states)
        for i, (a, b) in enumerate(pairs):
            if i in failed:
                assert "injected copy failure" in s.ticket_error(tickets[i])
                assert not torch.equal(a, b)  # half a chunk landed: the data has a hole
            else:
                assert torch.equal(a, b)
        assert s.stats()["levels"][2]["failed"] == 4
    finally:
        s.close()


def test_nan_and_infinite_rates_are_refused():
    import math

    from pdflash.native import SchedulerError

    for bad in (math.nan, math.inf, -1.0, 0.0):
        with pytest.raises(SchedulerError):
            Scheduler(link_gbps=bad)
    with pytest.raises(SchedulerError):
        Scheduler(paced=True)  # paced needs a simulated link
    with Scheduler() as s:
        src, dst = torch.ones(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
        t = s.submit(make_key(0, 0), src, dst)
        with pytest.raises(SchedulerError):
            s.wait(t, timeout=math.nan)
        assert s.wait(t, timeout=30) is WaitStatus.DONE


@pytest.mark.gpu
def test_cuda_copies_wait_for_work_queued_on_their_destination():
    """A copy into a CUDA tensor lands after the kernels queued on PyTorch's stream before the
    submit (the scheduler copies on streams of its own), and DONE means the bytes are there."""
    n = 64 << 20
    src = torch.randint(1, 256, (n,), dtype=torch.uint8).pin_memory()
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    with Scheduler(backend="cuda", workers=2) as s:
        for trial in range(4):
            torch.cuda._sleep(50_000_000)  # tens of ms of GPU time queued first
            dst.fill_(7)  # behind it on PyTorch's stream
            t = s.submit(make_key(0, trial), src, dst, priority=Band.ON_DEMAND)
            assert s.wait(t, timeout=60) is WaitStatus.DONE
            assert torch.equal(dst.cpu(), src)  # the fill ran first, then the copy
            dst.zero_()
            ev = torch.cuda.Event()
            ev.record()
            t = s.submit(make_key(1, trial), src, dst, priority=Band.ON_DEMAND, after=ev)
            assert s.wait(t, timeout=60) is WaitStatus.DONE
            assert torch.equal(dst.cpu(), src)
