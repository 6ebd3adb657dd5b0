"""What one device -> CPU -> device hand-off costs inside a CUDA graph: the price a host step pays
per layer between its layers' CPU work, measured with a tiny layer instead of a real one.

    python benchmarks/handoff_gpu.py --layers 36 --replays 50 --out handoff.json

Graphs of ``--layers`` layers each, replayed ``--replays`` times after a warm-up; per layer:

- ``copies``: a tiny kernel, the routing-sized copy down (``--down-bytes``, device -> page-locked
  host), the result-sized copy up (``--up-bytes``, page-locked host -> device): no hand-off;
- ``host_node``: the same with a host node between the copies running one tiny CPU layer
  (``pf_layer_host_fn``: one 64-wide MXFP4 expert, one token), as host steps with
  ``PDFLASH_HOST_HANDOFF=node`` run;
- ``relay``: the same layer handed over by flags, as host steps run by default: the graph writes
  the layer's down flag and waits for its up flag (stream memory operations), the relay thread
  (``native/pf_relay.c``), armed before each replay, runs the layer and answers;
- ``writes_only`` / ``waits_preset``: the relay's memory operations alone (the writes, no waits;
  the waits with their flags set before the replay, no CPU thread): their own cost.

Reports each graph's microseconds per layer (median over replays) and the hand-offs' cost above
``copies``. Needs a CUDA device; without one it says so on stderr and exits 2. The memory
operation graphs are reported as unavailable where the driver has no stream memory operations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

MODES = ("copies", "host_node", "relay", "writes_only", "waits_preset")


def _tiny_layers(kernel, layers: int):
    """``layers`` one-token CPU layers of one 64-wide MXFP4 expert (a few microseconds each)."""
    import torch

    from pdflash.native.cpu_experts import ExpertWeights

    g = torch.Generator().manual_seed(0)
    H, I = 64, 32
    w = ExpertWeights.mxfp4(torch.randint(0, 256, (2 * I, H // 32, 16), dtype=torch.uint8, generator=g),
                            torch.full((2 * I, H // 32), 127, dtype=torch.uint8), None,
                            torch.randint(0, 256, (H, I // 32, 16), dtype=torch.uint8, generator=g),
                            torch.full((H, I // 32), 127, dtype=torch.uint8), None)
    structs = [w.struct(kernel.ffi)]
    return [kernel.layer(structs, 1, 1, torch.zeros(1, dtype=torch.int64), torch.ones(1), torch.randn(1, H),
                         torch.zeros(1, H)) for _ in range(layers)], w


def measure(torch, layers: int, replays: int, down_bytes: int, up_bytes: int) -> dict:
    from pdflash.native.cpu_experts import CpuExperts
    from pdflash.offload.host_graph import RELAY_SPIN_US, _Flags, _host_buffer, _launcher

    dev = torch.device("cuda")
    x = torch.zeros(1024, device=dev)
    down_dev = torch.zeros(down_bytes // 4, device=dev)
    # page-locked in place as host steps' buffers are (PyTorch's pinned allocator would record
    # events on its own blocks inside the capture)
    down_host = _host_buffer(down_bytes // 4, torch.float32, True)[0]
    up_host = _host_buffer(up_bytes // 4, torch.float32, True)[0]
    up_dev = torch.zeros(up_bytes // 4, device=dev)
    launch = _launcher(dev)  # host steps' own: cudaLaunchHostFunc on the current stream
    flags = _Flags.make(layers, dev)
    kernel = CpuExperts(threads=1)
    cpu_layers, keep = _tiny_layers(kernel, layers)
    relay = kernel.relay(flags.host, RELAY_SPIN_US) if flags is not None else None

    def layer_body(i: int, mode: str) -> None:
        x.add_(1.0)
        down_host.copy_(down_dev, non_blocking=True)
        if mode == "host_node":
            launch(cpu_layers[i].host_fn, cpu_layers[i].handle)
        elif mode == "relay":
            flags.signal(i)
        elif mode in ("writes_only", "waits_preset"):
            (flags.write if mode == "writes_only" else flags.wait)(i)
        up_dev.copy_(up_host, non_blocking=True)

    def capture(mode: str):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(layers):
                layer_body(i, mode)
        return g

    out: dict = {"layers": layers, "replays": replays, "down_bytes": down_bytes, "up_bytes": up_bytes,
                 "device": torch.cuda.get_device_name(0)}
    try:
        for mode in MODES:
            if mode not in ("copies", "host_node") and flags is None:
                out[mode] = {"error": "no stream memory operations here (driver functions, mapped memory or the probe)"}
                continue
            try:
                g = capture(mode)
            except Exception as exc:  # a capture the driver refuses
                out[mode] = {"error": f"capture failed: {exc}"}
                continue
            times, error = [], None
            for r in range(replays + 3):
                if mode == "relay":
                    relay.arm(cpu_layers, timeout_s=10.0)
                elif mode in ("writes_only", "waits_preset"):
                    flags.host.zero_()
                    if mode == "waits_preset":
                        flags.host[layers:] = 1
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                g.replay()
                end.record()
                deadline = time.monotonic() + 15.0
                while not end.query():  # never a wait without end
                    if time.monotonic() > deadline:
                        if relay is not None:
                            relay.cancel()
                        flags.host[layers:] = 1
                        torch.cuda.synchronize()
                        error = f"replay {r} did not finish within 15 s"
                        break
                    time.sleep(0.0002)
                if mode == "relay":
                    try:
                        relay.wait(10.0)
                    except Exception as exc:
                        error = error or f"replay {r}: {exc}"
                if error:
                    break
                if mode == "writes_only" and int((flags.host[:layers] == 1).sum()) != layers:
                    error = f"replay {r}: not every down flag read 1 on the host after the replay"
                    break
                if r >= 3:
                    times.append(start.elapsed_time(end) / 1e3)
            if error is not None:
                out[mode] = {"error": error}
                continue
            med = statistics.median(times)
            out[mode] = {"us_per_layer": 1e6 * med / layers, "us_per_replay": 1e6 * med,
                         "us_per_layer_min": 1e6 * min(times) / layers}
    finally:
        torch.cuda.synchronize()
        kernel.close()  # the relay first, then the layers
        if flags is not None:
            flags.close()
    del keep
    base_us = out["copies"].get("us_per_layer")
    for mode in MODES[1:]:
        if base_us is not None and "us_per_layer" in out[mode]:
            out[mode]["handoff_us"] = out[mode]["us_per_layer"] - base_us
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
