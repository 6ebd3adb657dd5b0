"""Benchmarks of the native fetch scheduler (``pdflash.native``); ``make bench`` runs this.

    python benchmarks/bench_scheduler.py                 # CPU: tiny tasks, overtake, wake floor
    python benchmarks/bench_scheduler.py --quick --json  # fewer samples, one JSON object
    python benchmarks/bench_scheduler.py --cuda --out cuda.json   # on a GPU machine

CPU part (memcpy backend):
  tiny      tasks per second, submit to complete, of 64-byte copies with distinct keys and
            destinations: from C (native/stress/bench.c, built here with ``cc -O2``, so no
            Python is in the timed path) and from Python through ``Scheduler``. Every
            destination is checked byte for byte afterwards.
  overtake  a background queue saturates a simulated 1 GB/s link with large tasks; at
            random moments one on-demand task of one chunk is submitted and waited for.
            Reported per sample: queue wait (submit -> first chunk claimed by a worker, from
            the level statistics) and link start (submit -> done minus the task's own
            transfer time, i.e. how long it waited for the link). Aim: link start at most
            one chunk time + 50 us.
  link      the rate the simulated link delivers to one large task, per chunk size and
            worker count, against its configured 1 GB/s. A worker keeps one chunk
            outstanding, so with one prefetch worker the link idles for the worker's turn-
            around between chunks; small chunks lose more.
  wake      the machine's floor: how long a thread blocked on a condition variable takes
            to run after being signalled. Overtake tails cannot be shorter than this.

CUDA part (``--cuda``; needs a CUDA build of PyTorch and a GPU):
  h2d       1 GiB host (pinned) -> device through the scheduler (64 tasks of 16 MiB, and one
            task of 1 GiB) for several chunk sizes and worker counts, against a plain pinned
            ``torch`` copy of the same bytes in the same run; the scheduler's copy is checked
            equal to the plain copy on the device. Aim: at least 90 % of the plain copy.
  overtake  the same overtake measurement on the real link, background tasks saturating it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

from pdflash.native import Band

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- statistics ----------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty list."""
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q * len(v) + 0.5)) - 1))]


def dist_us(values_ns: list[float]) -> dict:
    """p50 / p90 / p99 / max of nanosecond samples, in microseconds."""
    if not values_ns:
        return {"n": 0}
    return {
        "n": len(values_ns),
        "p50_us": pct(values_ns, 0.50) / 1e3,
        "p90_us": pct(values_ns, 0.90) / 1e3,
        "p99_us": pct(values_ns, 0.99) / 1e3,
        "max_us": max(values_ns) / 1e3,
    }


def machine_info() -> dict:
    from pdflash.machine import machine_info as _machine

    return _machine("cuda")


# ---- the C benchmark -------------------------------------------------------------------
def build_c_bench(out_dir: str) -> str | None:
    """Compile native/stress/bench.c with pf_sched.c; None (with a warning) without a compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        print("warning: no C compiler found; skipping the C measurements", file=sys.stderr)
        return None
    exe = os.path.join(out_dir, "bench_sched")
    native = os.path.join(ROOT, "native")
    cmd = [cc, "-std=c11", "-O2", "-pthread", f"-I{native}", "-o", exe,
           os.path.join(native, "stress", "bench.c"), os.path.join(native, "pf_sched.c"), "-ldl"]
    subprocess.run(cmd, check=True)
    return exe


def run_c(exe: str, *args: str) -> list[dict]:
    out = subprocess.run([exe, *args], check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@dataclass
class TinyResult:
    """One tiny-task configuration: tasks per second over repetitions (median and best)."""

    path: str  # "C" or "Python (<argument kind>)"
    workers: int
    window: int  # outstanding tasks per submitter; 0: submit all, then wait all
    submitters: int
    priority: int
    n: int
    median_per_s: float
    best_per_s: float
    reps: list[float] = field(default_factory=list)
    exact: bool = True


def bench_tiny_c(exe: str, quick: bool) -> list[TinyResult]:
    n = 200_000  # shorter runs mostly measure thread start-up and scheduling noise
    reps = 3 if quick else 7
    configs = [  # workers, window, submitters, priority
        (2, 0, 1, 0), (2, 1024, 1, 0), (2, 1024, 2, 0), (2, 1024, 1, 2), (1, 1024, 1, 0), (2, 1, 1, 0)]
    out = []
    for workers, window, subs, prio in configs:
        nn = n // 10 if window == 1 else n
        rows = run_c(exe, "tiny", "--n", str(nn), "--workers", str(workers), "--window", str(window),
                     "--submitters", str(subs), "--priority", str(prio), "--reps", str(reps))
        rates = [r["tasks_per_s"] for r in rows]
        exact = all(r["wrong"] == 0 and r["not_done"] == 0 and r["chunks"] == nn for r in rows)
        out.append(TinyResult("C", workers, window, subs, prio, nn, pct(rates, 0.5), max(rates), rates, exact))
    return out


def bench_tiny_py(quick: bool) -> list[TinyResult]:
    import numpy as np
    import torch

    from pdflash.native import Scheduler, WaitStatus

    n = 10_000 if quick else 50_000
    reps = 3
    out = []
    src_np = (np.arange(64, dtype=np.uint8) * 7 + 1).astype(np.uint8)
    for kind in ("address", "torch", "numpy"):
        for window in (0, 1):
            nn = n // 5 if window == 1 else n
            rates, exact = [], True
            for _ in range(reps):
                dst = np.zeros(nn * 64, dtype=np.uint8)
                if kind == "address":
                    srcs = [src_np.ctypes.data] * nn
                    dsts = [dst.ctypes.data + i * 64 for i in range(nn)]
                elif kind == "torch":
                    st, dt = torch.from_numpy(src_np), torch.from_numpy(dst).view(nn, 64)
                    srcs, dsts = [st] * nn, [dt[i] for i in range(nn)]
                else:
                    dv = dst.reshape(nn, 64)
                    srcs, dsts = [src_np] * nn, [dv[i] for i in range(nn)]
                with Scheduler(workers=2, history=1 << 17) as s:
                    t0 = time.perf_counter()
                    if window == 0:
                        tickets = [s.submit(i, srcs[i], dsts[i], 64, Band.ON_DEMAND) for i in range(nn)]
                        ok = all(s.wait(t) is WaitStatus.DONE for t in tickets)
                    else:
                        ok = all(s.wait(s.submit(i, srcs[i], dsts[i], 64, Band.ON_DEMAND)) is WaitStatus.DONE
                                 for i in range(nn))
                    dt_s = time.perf_counter() - t0
                exact &= ok and bool((dst.reshape(nn, 64) == src_np).all())
                rates.append(nn / dt_s)
            out.append(TinyResult(f"Python ({kind})", 2, window, 1, 0, nn, pct(rates, 0.5), max(rates), rates, exact))
    return out


# ---- overtake ----------------------------------------------------------------------------
@dataclass
class OvertakeResult:
    path: str
    backend: str
    link: str  # "1 GB/s simulated" or "measured NN GB/s"
    workers: int
    chunk_bytes: int
    chunk_us: float  # one chunk's time on the link
    own_us: float  # the on-demand task's submit -> done alone on an idle link (median of 5)
    samples: int
    saturated: int  # samples taken while background work was queued
    exact: bool
    queue_wait: dict
    link_start: dict  # submit -> done minus own transfer
    done: dict
    aim_us: float  # one chunk time + 50 us
    p50_within_aim: bool
    p99_within_aim: bool


def summarize_overtake(path, backend, link, workers, chunk, chunk_s, own_s, qw_ns, done_ns, saturated, exact):
    start = [max(0.0, d - own_s * 1e9) for d in done_ns]
    aim = chunk_s * 1e6 + 50.0
    ls = dist_us(start)
    return OvertakeResult(path, backend, link, workers, chunk, chunk_s * 1e6, own_s * 1e6, len(done_ns), saturated,
                          exact, dist_us(qw_ns), ls, dist_us(done_ns), aim,
                          ls.get("p50_us", 1e18) <= aim, ls.get("p99_us", 1e18) <= aim)


def bench_overtake_c(exe: str, quick: bool) -> list[OvertakeResult]:
    samples = 80 if quick else 300
    out = []
    for workers, chunk in ((2, 1 << 20), (2, 256 << 10), (4, 1 << 20)):
        d = run_c(exe, "overtake", "--gbps", "1", "--chunk", str(chunk), "--od-bytes", str(chunk),
                  "--bg-bytes", str(32 * chunk), "--workers", str(workers), "--samples", str(samples))[0]
        out.append(summarize_overtake("C", "memcpy", "1 GB/s simulated", workers, chunk, d["chunk_s"],
                                      d["od_alone_s"], d["queue_wait_ns"], d["done_ns"], d["saturated"],
                                      d["wrong"] == 0))
    return out


def overtake_py(sched_kwargs: dict, alloc_src, alloc_dst, chunk: int, link_gbps: float, samples: int,
                bg_tasks: int, path: str, link: str) -> OvertakeResult:
    """Overtake through the Python wrapper. alloc_src(n) / alloc_dst(n) give byte tensors.

    A feeder thread keeps ``bg_tasks`` background tasks of 32 chunks queued; the main
    thread submits one on-demand task of one chunk at random offsets and waits for it.
    ``link_gbps`` converts bytes to link time for the chunk-time reference.
    """
    import torch

    from pdflash.native import Scheduler, WaitStatus

    bg_bytes = 32 * chunk
    bg_src = alloc_src(bg_bytes)
    bg_dst = alloc_dst(bg_tasks * bg_bytes)
    od_src = alloc_src(chunk)
    od_src.copy_(torch.randint(0, 256, (chunk,), dtype=torch.uint8))
    od_dst = alloc_dst(chunk)
    chunk_s = chunk / (link_gbps * 1e9)
    with Scheduler(chunk_bytes=chunk, **sched_kwargs) as s:
        # the on-demand task alone on an idle link: its own transfer time
        own = []
        for i in range(5):
            t0 = time.perf_counter_ns()
            s.wait(s.submit(10**6 + i, od_src, od_dst, priority=Band.ON_DEMAND))
            own.append(time.perf_counter_ns() - t0)
        own_s = pct(own, 0.5) / 1e9
        stop = threading.Event()

        def feed():
            ring = [0] * bg_tasks
            key = 1 << 40
            i = 0
            while not stop.is_set():
                if ring[i]:
                    s.wait(ring[i])
                if stop.is_set():
                    break
                ring[i] = s.submit(key, bg_src, bg_dst[i * bg_bytes:(i + 1) * bg_bytes], priority=Band.BACKGROUND)
                key += 1
                i = (i + 1) % bg_tasks

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        time.sleep(max(0.05, 20 * chunk_s))
        rng = random.Random(7)
        qw, done, saturated, exact = [], [], 0, True
        for i in range(samples):
            time.sleep(chunk_s * (0.3 + rng.random()))
            a = s.stats()["levels"]
            saturated += a[Band.BACKGROUND]["queue_depth"] >= 2
            od_dst.zero_()
            t0 = time.perf_counter_ns()
            st = s.wait(s.submit(i, od_src, od_dst, priority=Band.ON_DEMAND))
            done.append(time.perf_counter_ns() - t0)
            b = s.stats()["levels"]
            qw.append(b[0]["queue_wait_ns"] - a[0]["queue_wait_ns"])
            exact &= st is WaitStatus.DONE and bool(torch.equal(od_dst, od_src.to(od_dst.device)))
        stop.set()
        s.cancel_band(Band.BACKGROUND)
        feeder.join(timeout=30)
    backend = sched_kwargs.get("backend", "memcpy")
    return summarize_overtake(path, backend, link, sched_kwargs.get("workers", 2), chunk, chunk_s, own_s, qw, done,
                              saturated, exact)


def bench_overtake_py_cpu(quick: bool) -> OvertakeResult:
    import torch

    def alloc(n):
        return torch.zeros(n, dtype=torch.uint8)

    return overtake_py({"workers": 2, "link_gbps": 1.0}, alloc, alloc, 1 << 20, 1.0, 40 if quick else 150, 4,
                       "Python", "1 GB/s simulated")


def bench_link(exe: str, quick: bool) -> list[dict]:
    rows = []
    for workers, prio in ((2, 2), (3, 2), (2, 0)):
        for chunk in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
            nbytes = max(32 * chunk, 64 << 20) // (2 if quick else 1)
            d = run_c(exe, "link", "--gbps", "1", "--chunk", str(chunk), "--bytes", str(nbytes),
                      "--workers", str(workers), "--priority", str(prio))[0]
            rows.append({"workers": workers, "priority": prio, "chunk_bytes": chunk, "bytes": nbytes,
                         "achieved_gbps": d["achieved_gbps"], "exact": bool(d["exact"])})
    return rows


def bench_wake(exe: str, quick: bool) -> dict:
    d = run_c(exe, "wake", "--idle-us", "700", "--samples", "150" if quick else "400")[0]
    return {"idle_us": d["idle_us"], **dist_us(d["wake_ns"])}


# ---- CUDA ---------------------------------------------------------------------------------
def bench_h2d(backend: str, dev, device_index: int, total: int, workers_list, chunk_mibs, task_mibs, reps: int,
              priorities=(Band.ON_DEMAND, Band.BACKGROUND)) -> dict:
    """Host -> ``dev`` throughput through the scheduler against a plain torch copy of the
    same pinned bytes in the same run; every scheduler copy is checked equal to the plain one.
    On-demand work may use every worker, prefetch levels (priority > 0) all but one, so
    both are measured. (backend "memcpy" with a CPU ``dev`` runs the same code without a GPU.)"""
    import torch

    from pdflash.native import Scheduler, WaitStatus

    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    src = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    src.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    ref = torch.empty(total, dtype=torch.uint8, device=dev)
    dst = torch.empty(total, dtype=torch.uint8, device=dev)

    def plain_copy() -> float:
        sync()
        t0 = time.perf_counter()
        ref.copy_(src, non_blocking=True)
        sync()
        return total / (time.perf_counter() - t0) / 1e9

    plain_copy()  # warm-up
    plain = [plain_copy() for _ in range(reps)]
    plain_gbps = pct(plain, 0.5)
    rows = []
    key = 0
    configs = [(w, c, t, p) for w in workers_list for c in chunk_mibs for t in task_mibs for p in priorities]
    for workers, chunk_mib, task_mib, prio in configs:
        size = min(task_mib << 20, total)
        ntask = total // size
        rates, exact = [], True
        with Scheduler(backend=backend, workers=workers, chunk_bytes=chunk_mib << 20, device=device_index) as s:
            for rep in range(reps + 1):  # the first is a warm-up
                dst.zero_()
                sync()
                t0 = time.perf_counter()
                tickets = []
                for i in range(ntask):
                    tickets.append(s.submit(key, src[i * size:(i + 1) * size], dst[i * size:(i + 1) * size],
                                            priority=prio))
                    key += 1
                ok = all(s.wait(t) is WaitStatus.DONE for t in tickets)
                dt = time.perf_counter() - t0
                if rep:
                    rates.append(total / dt / 1e9)
                    exact &= ok and bool(torch.equal(dst, ref))
        med = pct(rates, 0.5)
        rows.append({"workers": workers, "priority": int(prio), "chunk_mib": chunk_mib, "task_mib": size >> 20,
                     "tasks": ntask, "gbps_median": med, "gbps_best": max(rates), "reps": rates,
                     "ratio_to_plain": med / plain_gbps, "exact": exact})
        print(f"  h2d workers={workers} priority={prio} chunk={chunk_mib} MiB tasks={ntask}x{size >> 20} MiB: "
              f"{med:.1f} GB/s ({100 * med / plain_gbps:.0f} % of plain {plain_gbps:.1f})", file=sys.stderr)
    return {"plain_gbps": plain_gbps, "plain_reps": plain, "h2d": rows}


def bench_cuda(device: int, quick: bool) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: --cuda needs a CUDA build of PyTorch and a visible GPU")
    dev = torch.device(f"cuda:{device}")
    torch.cuda.set_device(dev)
    reps = 3 if quick else 5
    res = bench_h2d("cuda", dev, device, 1 << 30, (1, 2, 4), (1, 4, 16), (16, 1024), reps)
    torch.cuda.empty_cache()
    plain_gbps = res["plain_gbps"]

    def alloc_src(n):
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def alloc_dst(n):
        return torch.empty(n, dtype=torch.uint8, device=dev)

    overtake = []
    for workers, chunk in ((2, 4 << 20), (2, 1 << 20), (4, 4 << 20)):
        r = overtake_py({"backend": "cuda", "workers": workers, "device": device}, alloc_src, alloc_dst, chunk,
                        plain_gbps, 50 if quick else 200, 8, "Python", f"measured {plain_gbps:.1f} GB/s")
        overtake.append(asdict(r))
    return {"device": torch.cuda.get_device_name(dev), **res, "overtake": overtake}


# ---- output ----------------------------------------------------------------------------------
def print_tables(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 170))
    if res.get("tiny"):
        t = Table(title="Tiny copies (64 B), submit to complete", title_justify="left")
        for c in ("path", "workers", "window", "submitters", "priority", "tasks", "median /s", "best /s", "exact"):
            t.add_column(c, justify="right" if c not in ("path",) else "left")
        for r in res["tiny"]:
            win = "all" if r["window"] == 0 else str(r["window"])
            t.add_row(r["path"], str(r["workers"]), win, str(r["submitters"]), str(r["priority"]), str(r["n"]),
                      f"{r['median_per_s']:,.0f}", f"{r['best_per_s']:,.0f}", "yes" if r["exact"] else "NO")
        con.print(t)
    for key, title in (("overtake", "On-demand overtake, saturated link"),
                       ("cuda_overtake", "On-demand overtake, saturated real link")):
        rows = res.get(key) or []
        if not rows:
            continue
        t = Table(title=f"{title} (us; link start = submit->done minus own transfer)", title_justify="left")
        for c in ("path", "link", "workers", "chunk", "chunk us", "own us", "queue wait p50/p99/max",
                  "link start p50/p90/p99/max", "done p50/p99", "aim", "exact"):
            t.add_column(c)
        for r in rows:
            q, ls, d = r["queue_wait"], r["link_start"], r["done"]
            t.add_row(r["path"], r["link"], str(r["workers"]), f"{r['chunk_bytes'] >> 10} KiB", f"{r['chunk_us']:.0f}",
                      f"{r['own_us']:.0f}", f"{q['p50_us']:.0f} / {q['p99_us']:.0f} / {q['max_us']:.0f}",
                      f"{ls['p50_us']:.0f} / {ls['p90_us']:.0f} / {ls['p99_us']:.0f} / {ls['max_us']:.0f}",
                      f"{d['p50_us']:.0f} / {d['p99_us']:.0f}",
                      f"<= {r['aim_us']:.0f}: p50 {'ok' if r['p50_within_aim'] else 'over'}, "
                      f"p99 {'ok' if r['p99_within_aim'] else 'over'}",
                      "yes" if r["exact"] else "NO")
        con.print(t)
    if res.get("link"):
        t = Table(title="Simulated link (1 GB/s configured): rate delivered to one large task", title_justify="left")
        for c in ("workers", "priority", "chunk", "achieved GB/s", "exact"):
            t.add_column(c, justify="right")
        for r in res["link"]:
            t.add_row(str(r["workers"]), str(r["priority"]), f"{r['chunk_bytes'] >> 10} KiB",
                      f"{r['achieved_gbps']:.3f}", "yes" if r["exact"] else "NO")
        con.print(t)
    if res.get("wake"):
        w = res["wake"]
        con.print(f"Wake floor (condition variable, after {w['idle_us']:.0f} us idle): p50 {w['p50_us']:.1f} us, "
                  f"p90 {w['p90_us']:.1f}, p99 {w['p99_us']:.1f}, max {w['max_us']:.1f}")
    if res.get("cuda"):
        c = res["cuda"]
        t = Table(title=f"Host to device, 1 GiB, {c['device']} (plain pinned torch copy {c['plain_gbps']:.1f} GB/s)",
                  title_justify="left")
        for col in ("workers", "priority", "chunk MiB", "tasks", "GB/s median", "GB/s best", "% of plain", "exact"):
            t.add_column(col, justify="right")
        for r in c["h2d"]:
            t.add_row(str(r["workers"]), str(r["priority"]), str(r["chunk_mib"]), f"{r['tasks']} x {r['task_mib']} MiB",
                      f"{r['gbps_median']:.1f}", f"{r['gbps_best']:.1f}", f"{100 * r['ratio_to_plain']:.0f}",
                      "yes" if r["exact"] else "NO")
        con.print(t)
    con.print(f"machine: {res['machine']['cpu']}, {res['machine']['cpus']} CPUs, load average at start "
              f"{', '.join(f'{x:.2f}' for x in res['machine']['loadavg_start'])}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Fewer tasks and samples (for a fast check).")
    ap.add_argument("--json", action="store_true", help="Print one JSON object instead of tables.")
    ap.add_argument("--out", help="Also write the JSON results to this file.")
    ap.add_argument("--cuda", action="store_true", help="Measure the cuda backend on a GPU (skips the CPU part).")
    ap.add_argument("--device", type=int, default=0, help="CUDA device index for --cuda.")
    ap.add_argument("--skip", default="", help="Comma-separated parts to skip: tiny, overtake, link, wake, python.")
    args = ap.parse_args(argv)
    skip = {p.strip() for p in args.skip.split(",") if p.strip()}
    res: dict = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "machine": machine_info()}
    if args.cuda:
        cuda = bench_cuda(args.device, args.quick)
        res["cuda"] = cuda
        res["cuda_overtake"] = cuda["overtake"]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            exe = build_c_bench(tmp)
            res["tiny"], res["overtake"] = [], []
            if "tiny" not in skip:
                if exe:
                    res["tiny"] += [asdict(r) for r in bench_tiny_c(exe, args.quick)]
                if "python" not in skip:
                    res["tiny"] += [asdict(r) for r in bench_tiny_py(args.quick)]
            if "overtake" not in skip:
                if exe:
                    res["overtake"] += [asdict(r) for r in bench_overtake_c(exe, args.quick)]
                if "python" not in skip:
                    res["overtake"].append(asdict(bench_overtake_py_cpu(args.quick)))
            if exe and "link" not in skip:
                res["link"] = bench_link(exe, args.quick)
            if exe and "wake" not in skip:
                res["wake"] = bench_wake(exe, args.quick)
    res["machine"]["loadavg_end"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=2)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_tables(res)
    ok = all(r.get("exact", True) for r in res.get("tiny", []) + res.get("overtake", []) + res.get("link", []))
    if args.cuda:
        ok &= all(r["exact"] for r in res["cuda"]["h2d"]) and all(r["exact"] for r in res["cuda_overtake"])
    if not ok:
        print("error: a copy was not byte-exact", file=sys.stderr)
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
