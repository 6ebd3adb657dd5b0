"""What one device -> CPU -> device hand-off costs inside a CUDA graph: the price a host step pays
per layer between its host nodes, measured without any expert work.

    python benchmarks/handoff_gpu.py --layers 36 --replays 50 --out handoff.json

Three graphs of ``--layers`` layers each, replayed ``--replays`` times after a warm-up; per layer:

- ``copies``: a tiny kernel, the routing-sized copy down (``--down-bytes``, device -> page-locked
  host), the result-sized copy up (``--up-bytes``, page-locked host -> device): no hand-off;
- ``host_node``: the same with a host node between the copies, as host steps run today
  (``cudaLaunchHostFunc`` of a C function that does nothing: ``free(NULL)``);
- ``mem_ops``: the same with a stream write of a sequence number to a page-locked flag, then a
  stream wait until a second flag reaches it (``cuStreamWriteValue32`` / ``cuStreamWaitValue32``,
  captured as memory-operation nodes), a CPU thread polling the first flag and answering on the
  second: a hand-off without the driver's callback thread.

Two more graphs isolate the memory operations when ``mem_ops`` fails: ``writes_only`` (the
writes, no waits; after each replay every down flag must read ``SEQ`` on the host) and
``waits_preset`` (the waits, their flags set before the replay: no CPU thread involved). A replay
that does not finish reports the flags it left and how many the polling thread answered.

Reports each graph's microseconds per layer (median over replays) and the hand-offs' cost above
``copies``. Needs a CUDA device; without one it says so on stderr and exits 2. ``mem_ops`` is
reported as unavailable (with the driver's error) where the driver refuses stream memory
operations or their capture.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import statistics
import sys
import threading
import time
from pathlib import Path

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT
MEM_OPS = ("mem_ops", "writes_only", "waits_preset")
SEQ = 1  # the value each layer's flags take in a replay (fixed at capture; the flags are zeroed between replays)


def _driver_fn(lib, *names):
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
            fn.restype = ctypes.c_int
            return fn
    return None


def measure(torch, layers: int, replays: int, down_bytes: int, up_bytes: int) -> dict:
    dev = torch.device("cuda")
    x = torch.zeros(1024, device=dev)
    down_dev = torch.zeros(down_bytes // 4, device=dev)
    # page-locked in place as host steps' buffers are (PyTorch's pinned allocator would record
    # events on its own blocks inside the capture)
    from pdflash.offload.host_graph import _host_buffer, _launcher

    down_host = _host_buffer(down_bytes // 4, torch.float32, True)[0]
    up_host = _host_buffer(up_bytes // 4, torch.float32, True)[0]
    up_dev = torch.zeros(up_bytes // 4, device=dev)
    launch = _launcher(dev)  # host steps' own: cudaLaunchHostFunc on the current stream
    free = ctypes.cast(ctypes.CDLL(ctypes.util.find_library("c")).free, ctypes.c_void_p).value
    libcuda = ctypes.CDLL("libcuda.so.1")
    wait32 = _driver_fn(libcuda, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
    write32 = _driver_fn(libcuda, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
    # [down flags | up flags], never copied by PyTorch: its pinned allocator's blocks are mapped for
    # the device at the same address (unified addressing)
    flags = torch.zeros(2 * layers, dtype=torch.int32).pin_memory()
    base = flags.data_ptr()

    def layer_body(i: int, handoff: str) -> None:
        x.add_(1.0)
        down_host.copy_(down_dev, non_blocking=True)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if handoff == "host_node":
            launch(free, 0)
        elif handoff in MEM_OPS:  # the graph writes SEQ to down flag i, waits for up flag i >= SEQ
            rc = write32(stream, base + 4 * i, SEQ, WRITE_DEFAULT) if handoff != "waits_preset" else 0
            if handoff != "writes_only":
                rc = rc or wait32(stream, base + 4 * (layers + i), SEQ, WAIT_GEQ)
            if rc:
                raise RuntimeError(f"stream memory operation failed (CUDA driver error {rc})")
        up_dev.copy_(up_host, non_blocking=True)

    def capture(handoff: str):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(layers):
                layer_body(i, handoff)
        return g

    out: dict = {"layers": layers, "replays": replays, "down_bytes": down_bytes, "up_bytes": up_bytes,
                 "device": torch.cuda.get_device_name(0)}
    for handoff in ("copies", "host_node") + MEM_OPS:
        if handoff in MEM_OPS and (wait32 is None or write32 is None):
            out[handoff] = {"error": "the driver exports no cuStreamWaitValue32 / cuStreamWriteValue32"}
            continue
        stop = threading.Event()
        poller = None
        view = flags.numpy()
        answered = [0]
        if handoff == "mem_ops":

            def poll():  # answers each layer's flag as soon as the graph wrote it
                nxt = 0
                while not stop.is_set():
                    if view[nxt] >= SEQ:
                        view[layers + nxt] = SEQ
                        answered[0] += 1
                        nxt = (nxt + 1) % layers
            poller = threading.Thread(target=poll, daemon=True)
        try:
            g = capture(handoff)
        except RuntimeError as exc:
            out[handoff] = {"error": str(exc)}
            continue
        except Exception as exc:  # a capture the driver refuses
            out[handoff] = {"error": f"capture failed: {exc}"}
            continue
        if poller is not None:
            poller.start()
        times, error = [], None
        try:
            for r in range(replays + 3):
                if handoff in MEM_OPS:
                    flags.zero_()
                if handoff == "waits_preset":
                    view[layers:] = SEQ
                # timed on the device: the poller holds the interpreter lock while this thread
                # waits, so host clocks would also time the lock's hand-back
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                g.replay()
                end.record()
                deadline = time.monotonic() + 10.0
                while not end.query():  # never a wait without end: a lost answer would hang the device
                    if time.monotonic() > deadline:
                        down_seen = int((view[:layers] >= SEQ).sum())
                        up_set = int((view[layers:] >= SEQ).sum())
                        view[layers:] = 2**31 - 1  # release every wait, then report
                        torch.cuda.synchronize()
                        raise RuntimeError(
                            f"replay {r} did not finish within 10 s (the graph's waits were not answered): "
                            f"{down_seen} of {layers} down flags written, {up_set} up flags set, "
                            f"{answered[0]} answers from the polling thread")
                    time.sleep(0.01)
                if handoff == "writes_only" and int((view[:layers] >= SEQ).sum()) != layers:
                    raise RuntimeError(f"replay {r}: only {int((view[:layers] >= SEQ).sum())} of {layers} "
                                       "down flags read SEQ on the host after the replay")
                if r >= 3:
                    times.append(start.elapsed_time(end) / 1e3)
        except RuntimeError as exc:
            error = str(exc)
        finally:
            stop.set()
            if poller is not None:
                poller.join(timeout=5)
        if error is not None:
            out[handoff] = {"error": error}
            continue
        med = statistics.median(times)
        out[handoff] = {"us_per_layer": 1e6 * med / layers, "us_per_replay": 1e6 * med,
                        "us_per_layer_min": 1e6 * min(times) / layers}
    base_us = out["copies"].get("us_per_layer")
    for handoff in ("host_node",) + MEM_OPS:
        if base_us is not None and "us_per_layer" in out[handoff]:
            out[handoff]["handoff_us"] = out[handoff]["us_per_layer"] - base_us
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--down-bytes", type=int, default=24 * 1024, help="the routing pack's size (default 24 KiB)")
    ap.add_argument("--up-bytes", type=int, default=46080, help="the CPU rows' size (default 4 x 2880 float32)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.layers < 1 or args.replays < 1 or args.down_bytes < 4 or args.up_bytes < 4:
        print("Error: --layers and --replays must be >= 1, the byte counts >= 4", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("Error: handoff_gpu.py needs a CUDA device; run it on the GPU machine", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _checkout import import_pdflash

    import_pdflash()
    res = measure(torch, args.layers, args.replays, args.down_bytes, args.up_bytes)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
