"""Many Python threads driving one scheduler at once, with integrity checks afterwards.

Each "slot" owns a source pattern and a destination. Afterwards:
- every ticket ended DONE or CANCELLED;
- a slot with a DONE ticket holds its source byte for byte;
- a slot whose tickets were all cancelled holds a chunk-aligned prefix of its source
  (the chunks claimed before the cancel) and untouched zeros after it;
- without resets the statistics agree exactly with what the threads saw, and the link
  (1 GB/s == 1 byte per ns) carried exactly the bytes of the chunks that ran.
The C stress test (native/stress/stress.c) does the same at a larger scale under the
sanitizers; a quick unsanitized run of it is included here when a compiler exists.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import threading

import pytest
import torch

from pdflash.native import Band, Scheduler, SchedulerClosed, WaitStatus, make_key

CH = 4096
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Slot:
    def __init__(self, i: int, nbytes: int, rng: random.Random):
        g = torch.Generator().manual_seed(1000 + i)
        self.key = make_key(i % 5, i)
        self.src = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, generator=g)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.lock = threading.Lock()
        self.tickets: list[int] = []
        self.published = False

    def record(self, t: int) -> None:
        with self.lock:
            if t not in self.tickets:
                self.tickets.append(t)


def make_slots(n: int, seed: int) -> list[Slot]:
    rng = random.Random(seed)
    sizes = [rng.choice([rng.randint(1, CH), rng.randint(CH, 6 * CH), rng.randint(8 * CH, 24 * CH)]) for _ in range(n)]
    return [Slot(i, sizes[i], rng) for i in range(n)]


def check_slots(s: Scheduler, slots: list[Slot], statuses: dict[int, WaitStatus]) -> tuple[int, int]:
    """Data checks; returns the bounds (lo, hi) on the bytes the chunks copied."""
    lo = hi = 0
    for sl in slots:
        if not sl.tickets:
            assert not sl.dst.any()
            continue
        st = [statuses[t] for t in sl.tickets]
        diff = (sl.src != sl.dst).nonzero()
        k = int(diff[0]) if len(diff) else len(sl.src)
        ndone, ncanc = st.count(WaitStatus.DONE), st.count(WaitStatus.CANCELLED)
        if ndone:
            assert k == len(sl.src), f"slot {sl.key:x}: DONE but differs at byte {k}"
        else:
            assert k % CH == 0 and k < len(sl.src) and not sl.dst[k:].any(), f"slot {sl.key:x}: prefix {k}"
        n = len(sl.src)
        lo += ndone * n + (k if not ndone else 0) * (len(st) == ncanc)
        hi += ndone * n + ncanc * (-(-n // CH) - 1) * CH
        if len(st) == 1 and ncanc:  # one cancelled ticket: its copied bytes are exactly the prefix
            hi -= (-(-n // CH) - 1) * CH - k
    return lo, hi


def run_threads(s: Scheduler, slots: list[Slot], nthreads: int, ops: int, seed: int, resets: bool) -> dict:
    """Random operations from nthreads threads; returns caller-side counts."""
    next_slot = [0]
    take = threading.Lock()
    counts = {"submits": 0, "cancel_hits": 0, "errors": []}
    count_lock = threading.Lock()

    def worker(tid: int) -> None:
        rng = random.Random(seed * 100 + tid)
        try:
            for _ in range(ops):
                x = rng.random()
                published = [sl for sl in slots[max(0, next_slot[0] - 24):next_slot[0]] if sl.published]
                if x < 0.30:
                    with take:
                        if next_slot[0] >= len(slots):
                            continue
                        sl = slots[next_slot[0]]
                        next_slot[0] += 1
                    t = s.submit(sl.key, sl.src, sl.dst, priority=rng.choice([0, 1, 2, 2, 5]))
                    sl.record(t)
                    sl.published = True
                    with count_lock:
                        counts["submits"] += 1
                elif x < 0.45 and published:  # same key again: dedup, or a new ticket once it ended
                    sl = rng.choice(published)
                    if len(sl.tickets) < 3:
                        sl.record(s.submit(sl.key, sl.src, sl.dst, priority=rng.choice([0, 1, 2])))
                        with count_lock:
                            counts["submits"] += 1
                elif x < 0.55 and published:
                    s.promote(rng.choice(published).key, rng.choice([0, 1]))
                elif x < 0.65 and published:
                    hit = s.cancel(rng.choice(published).key)
                    with count_lock:
                        counts["cancel_hits"] += hit
                elif x < 0.67:
                    n = s.cancel_below_layer(rng.randrange(3), min_priority=Band.BACKGROUND)
                    with count_lock:
                        counts["cancel_hits"] += n
                elif x < 0.90 and published:
                    sl = rng.choice(published)
                    with sl.lock:
                        t = rng.choice(sl.tickets)
                    r = s.wait(t, timeout=rng.choice([0, 0.001, 0.01, None]))
                    assert r in (WaitStatus.DONE, WaitStatus.CANCELLED, WaitStatus.TIMEOUT), r
                elif x < 0.97 and published:
                    sl = rng.choice(published)
                    with sl.lock:
                        t = rng.choice(sl.tickets)
                    assert s.query(t) in (WaitStatus.DONE, WaitStatus.CANCELLED, WaitStatus.PENDING)
                elif resets and x > 0.995:
                    s.reset()
                else:
                    st = s.stats()
                    assert sum(lv["in_flight"] for lv in st["levels"][1:]) <= max(1, s.workers - 1)
        except Exception as exc:  # reported by the main thread
            counts["errors"].append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not counts["errors"], counts["errors"][:3]
    return counts


def final_statuses(s: Scheduler, slots: list[Slot]) -> dict[int, WaitStatus]:
    out = {}
    for sl in slots:
        for t in sl.tickets:
            out[t] = s.wait(t)
            assert out[t] in (WaitStatus.DONE, WaitStatus.CANCELLED), (t, out[t])
    return out


@pytest.mark.parametrize("workers", [1, 3])
def test_many_threads_submit_wait_cancel_keep_data_and_counts_exact(workers):
    slots = make_slots(160, seed=workers)
    with Scheduler(workers=workers, chunk_bytes=CH, link_gbps=1.0) as s:
        counts = run_threads(s, slots, nthreads=8, ops=250, seed=workers, resets=False)
        statuses = final_statuses(s, slots)
        lo, hi = check_slots(s, slots, statuses)
        st = s.stats()
        tot = {k: sum(lv[k] for lv in st["levels"]) for k in ("submitted", "deduplicated", "completed", "cancelled",
                                                               "bytes", "queue_depth", "in_flight", "failed")}
        done = [t for t, r in statuses.items() if r is WaitStatus.DONE]
        cancelled = [t for t, r in statuses.items() if r is WaitStatus.CANCELLED]
        owner = {t: sl for sl in slots for t in sl.tickets}
        assert tot["submitted"] == len(statuses)
        assert tot["deduplicated"] == counts["submits"] - len(statuses)
        assert tot["completed"] == len(done) and tot["cancelled"] == len(cancelled)
        assert tot["bytes"] == sum(len(owner[t].src) for t in done)
        assert tot["cancelled"] <= counts["cancel_hits"]  # a revived task ends done
        assert tot["queue_depth"] == tot["in_flight"] == tot["failed"] == 0
        assert lo <= round(st["link_busy_s"] * 1e9) <= hi  # 1 GB/s: ns == bytes copied by chunks
        assert len(done) > 0 and len(cancelled) > 0


def test_many_threads_with_resets_still_end_every_ticket_cleanly():
    slots = make_slots(160, seed=7)
    with Scheduler(workers=2, chunk_bytes=CH, link_gbps=1.0) as s:
        run_threads(s, slots, nthreads=6, ops=250, seed=7, resets=True)
        statuses = final_statuses(s, slots)
        check_slots(s, slots, statuses)
        st = s.stats()
        assert all(lv["queue_depth"] == 0 and lv["in_flight"] == 0 for lv in st["levels"])
        src, dst = slots[0].src, torch.zeros_like(slots[0].src)
        assert s.wait(s.submit(make_key(99, 99), src, dst)) is WaitStatus.DONE and torch.equal(src, dst)


def test_close_while_threads_submit_and_wait():
    s = Scheduler(workers=2, chunk_bytes=CH, link_gbps=0.5)
    outcomes: list[str] = []
    started = threading.Barrier(7)

    def worker(tid: int) -> None:
        src = torch.full((8 * CH,), tid + 1, dtype=torch.uint8)
        started.wait()
        i = 0
        try:
            while True:
                dst = torch.zeros_like(src)
                r = s.wait(s.submit(make_key(tid, i), src, dst, priority=i % 3))
                if r is WaitStatus.CLOSED:
                    outcomes.append("closed")
                    return
                assert r is WaitStatus.DONE and torch.equal(src, dst), r
                i += 1
        except SchedulerClosed:
            outcomes.append("raised")
        except Exception as exc:
            outcomes.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    started.wait()
    threading.Event().wait(0.05)
    s.close()
    for th in threads:
        th.join(timeout=30)
    assert not any(th.is_alive() for th in threads)
    assert set(outcomes) <= {"closed", "raised"} and len(outcomes) == 6, outcomes


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_c_stress_quick(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    exe = tmp_path / "stress"
    native = os.path.join(ROOT, "native")
    subprocess.run([cc, "-std=c11", "-O2", "-pthread", f"-I{native}", "-o", str(exe),
                    os.path.join(native, "stress", "stress.c"), os.path.join(native, "pf_sched.c"), "-ldl"],
                   check=True)
    out = subprocess.run([str(exe), "--quick"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("stress: ") and " 0 failed" in out.stdout
