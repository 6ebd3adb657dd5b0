"""Can a captured decode step wait, on the device, for copies the scheduler's threads issue?

A host step that also fetches (the guard's "model" arm as one graph) would have each layer's host
node submit band-0 fetches to the native scheduler and compute the CPU's share, while the device
waits for those fetches before computing from their slots. A host node may not wait on CUDA work
itself, so the wait has to be a node of the graph: a stream memory operation
(``cuStreamWaitValue32``) on a flag that the fetch's stream sets after its copy
(``cuStreamWriteValue32``), or that a host thread sets. This probe measures, on one GPU:

  host-flag   a graph of [kernel, wait until a page-locked flag == 1, kernel, write flag = 0]; a
              host thread sets the flag ``--delays`` microseconds after the replay starts: how long
              after the write the replay ends (the release latency), against the same graph
              without the wait;
  copy-flag   a copy of ``--mib`` MiB from page-locked memory on a second stream followed by a
              device-side write of a device flag, and a graph that waits for that flag: the replay's
              end against the copy's own time (what the wait adds to the copy).

    python3 benchmarks/probe_graph_wait.py --out $OUT/graph_wait.json

Needs CUDA and the driver's stream memory operations (the V2 entry points, on by default).
Nothing here is part of pdflash's runtime; it decides whether that design can work.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import threading
import time
from pathlib import Path

WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT


def _driver():
    lib = ctypes.CDLL("libcuda.so.1")

    def entry(*names):
        for n in names:
            fn = getattr(lib, n, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                return fn
        raise RuntimeError(f"the CUDA driver has none of {names}")

    return {
        "wait": entry("cuStreamWaitValue32_v2", "cuStreamWaitValue32"),
        "write": entry("cuStreamWriteValue32_v2", "cuStreamWriteValue32"),
        "devptr": entry("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"),
    }


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc}")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def probe(args) -> dict:
    import torch

    drv = _driver()
    dev = torch.device("cuda")
    stream = torch.cuda.Stream(device=dev)
    x = torch.zeros(1 << 16, device=dev)

    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # written by a host thread
    flag_dev = ctypes.c_uint64()
    _check(drv["devptr"](ctypes.byref(flag_dev), ctypes.c_void_p(flag.data_ptr()), 0), "cuMemHostGetDevicePointer")
    cs = ctypes.c_void_p

    def capture(wait: bool):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            x.add_(1)
            if wait:
                s = cs(torch.cuda.current_stream().cuda_stream)
                _check(drv["wait"](s, flag_dev, ctypes.c_uint32(1), WAIT_EQ), "cuStreamWaitValue32 (captured)")
                x.mul_(1)
                _check(drv["write"](s, flag_dev, ctypes.c_uint32(0), WRITE_DEFAULT), "cuStreamWriteValue32 (captured)")
        return g

    plain, gated = capture(False), capture(True)
    out: dict = {"device": torch.cuda.get_device_name(dev), "host_flag": [], "copy_flag": None}

    def replay(g, delay_s: float | None) -> float:
        torch.cuda.synchronize()
        setter = None
        if delay_s is not None:
            def set_flag():
                _spin(delay_s)
                flag[0] = 1
            setter = threading.Thread(target=set_flag)
        t0 = time.perf_counter()
        if setter is not None:
            setter.start()
        g.replay()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if setter is not None:
            setter.join()
        return dt

    for _ in range(3):  # warm-up
        replay(plain, None)
        replay(gated, 0.0)
    base = statistics.median(replay(plain, None) for _ in range(args.repeats))
    for us in args.delays:
        times = [replay(gated, us / 1e6) for _ in range(args.repeats)]
        out["host_flag"].append({"delay_us": us, "median_us": statistics.median(times) * 1e6,
                                 "release_us": (statistics.median(times) - us / 1e6 - base) * 1e6,
                                 "plain_graph_us": base * 1e6})

    # copy-flag: a copy on another stream sets a device flag; the graph waits for it
    n = args.mib << 20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    dflag = torch.zeros(1, dtype=torch.int32, device=dev)
    dflag_ptr = ctypes.c_uint64(dflag.data_ptr())
    copier = torch.cuda.Stream(device=dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        s = cs(torch.cuda.current_stream().cuda_stream)
        _check(drv["wait"](s, dflag_ptr, ctypes.c_uint32(1), WAIT_EQ), "cuStreamWaitValue32 on a device flag")
        x.add_(1)
        _check(drv["write"](s, dflag_ptr, ctypes.c_uint32(0), WRITE_DEFAULT), "cuStreamWriteValue32 on a device flag")

    def copy_only() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(copier):
            dst.copy_(src, non_blocking=True)
        copier.synchronize()
        return time.perf_counter() - t0

    def copy_and_graph() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()  # waits on the device until the copy's stream sets the flag
        with torch.cuda.stream(copier):
            dst.copy_(src, non_blocking=True)
            _check(drv["write"](cs(copier.cuda_stream), dflag_ptr, ctypes.c_uint32(1), WRITE_DEFAULT),
                   "cuStreamWriteValue32 after the copy")
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(3):
        copy_only()
        copy_and_graph()
    c = statistics.median(copy_only() for _ in range(args.repeats))
    cg = statistics.median(copy_and_graph() for _ in range(args.repeats))
    out["copy_flag"] = {"mib": args.mib, "copy_us": c * 1e6, "copy_then_graph_us": cg * 1e6,
                        "added_us": (cg - c) * 1e6, "copy_gbps": n / c / 1e9}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delays", default="0,50,200,1000", help="comma-separated microseconds before the host sets the flag")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--mib", type=int, default=13, help="MiB copied in the copy-flag probe (one gpt-oss expert is 12.6)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here (else stdout)")
    args = ap.parse_args(argv)
    try:
        args.delays = [float(v) for v in args.delays.split(",") if v.strip()]
    except ValueError:
        print(f"error: --delays takes comma-separated microseconds, got {args.delays!r}", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.mib < 1 or any(d < 0 for d in args.delays):
        print("error: --repeats and --mib must be at least 1 and --delays not negative", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("error: this probe needs PyTorch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: this probe needs a CUDA device (none is visible here)", file=sys.stderr)
        return 2
    try:
        res = probe(args)
    except (OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(res, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
