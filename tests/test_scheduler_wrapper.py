"""The Python wrapper keeps src / dst alive exactly while their task is live."""

import threading

import pytest
import torch

from pdflash.native import Band, Scheduler, SchedulerError, WaitStatus, make_key


def test_query_of_ended_ticket_releases_buffers():
    with Scheduler(workers=1) as s:
        src, dst = torch.ones(1024, dtype=torch.uint8), torch.zeros(1024, dtype=torch.uint8)
        t = s.submit(make_key(0, 1), src, dst)
        while s.query(t) is WaitStatus.PENDING:
            pass
        assert t not in s._owners


def test_reset_keeps_buffers_of_tasks_still_live():
    with Scheduler(workers=2, link_gbps=0.5, chunk_bytes=1 << 16) as s:
        big = torch.ones(8 << 20, dtype=torch.uint8)
        s.submit(make_key(0, 0), big, torch.zeros_like(big), priority=Band.ON_DEMAND)
        started = threading.Event()
        late = {}

        def submit_during_reset():
            started.wait()
            src, dst = torch.full((1 << 20,), 7, dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
            late["t"] = s.submit(make_key(1, 0), src, dst, priority=Band.BACKGROUND)
            late["dst"] = dst

        th = threading.Thread(target=submit_during_reset)
        th.start()
        started.set()
        s.reset()
        th.join()
        status = s.wait(late["t"], timeout=30)
        # submitted before the reset's cancel: cancelled; during or after it: copied from a live src
        assert status in (WaitStatus.DONE, WaitStatus.CANCELLED)
        if status is WaitStatus.DONE:
            assert bool((late["dst"] == 7).all())


@pytest.mark.parametrize("bad", [1.5, "2", None])
def test_non_integer_priority_or_key_is_refused(bad):
    with Scheduler() as s:
        with pytest.raises(SchedulerError):
            s.submit(make_key(0, 0), bytearray(8), bytearray(8), priority=bad)
        with pytest.raises(SchedulerError):
            s.submit(bad, bytearray(8), bytearray(8))
