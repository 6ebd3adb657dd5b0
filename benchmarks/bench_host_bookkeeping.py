"""The Python between two host steps, on the CPU: what a decode step costs besides its graph.

    python benchmarks/bench_host_bookkeeping.py                     # the host arm, 36 layers x 128 experts
    python benchmarks/bench_host_bookkeeping.py --mode all --steps 400 --json

A seeded tiny-width MXFP4 checkpoint with gpt-oss-120b's layer and expert counts (36 x 128, top-4)
is loaded on the CPU with an expert cache of ``--cache-fraction`` of its experts; the graphed
decoder runs host steps of ``--mode`` ("host": the cache's hits on the device side, every other
expert on the CPU; "all": every expert on the CPU). The first steps run their step function for
real (its routing fills the host-step buffers); then each "replay" does nothing, so that what is
timed is everything else a decode step does in Python: the set-up before the launch, the
bookkeeping after it (``HostSteps.finish``) and the decoder's own work. Reported per step:
outside (all of it) and bookkeeping (``finish`` alone), in milliseconds, the median of
``--repeats`` runs of ``--steps`` steps. The "host" mode's hits use the fused kernel through
Triton's CPU interpreter during the real steps (TRITON_INTERPRET=1 and PDFLASH_FUSED_EXPERTS=1
are set for the run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import import_pdflash  # noqa: E402

import_pdflash()

from check_hybrid_gpu import _env  # noqa: E402 (a switch set for a block, then restored)
from pdflash.offload import host_graph  # noqa: E402
from pdflash.offload.config import ModelPreset  # noqa: E402
from pdflash.offload.graphs import GraphedDecoder  # noqa: E402
from pdflash.offload.runtime import OffloadedModel  # noqa: E402
from pdflash.offload.synthetic import write_checkpoint  # noqa: E402

MODES = ("all", "host")  # --mode: the guard's arm pinned, whose host steps are timed
PRESET = replace(ModelPreset.from_name("tiny"), name="tiny-36x128", num_hidden_layers=36, num_local_experts=128,
                 layer_types=())  # gpt-oss-120b's layers and experts at the tiny preset's width


def _capture_once(self, bucket: int, R: int, mode: str = "all") -> list:
    """GraphedDecoder._capture_host on the CPU: the step function runs once (the capture's
    warm-up, which fills the host-step buffers with its routing); each replay then does nothing."""
    steps = host_graph.HostSteps.for_runtime(self.rt)
    layers = steps.layers(R, self.dtype, mode)
    steps.before_step(mode, R, R)
    logits, xs = self._host_step_fn(bucket, R, layers)()
    return [SimpleNamespace(replay=lambda: None), logits, xs, layers, steps]


def measure(path: Path, mode: str, cache_fraction: float, steps: int, repeats: int) -> dict:
    capture, finish = GraphedDecoder._capture_host, host_graph.HostSteps.finish
    GraphedDecoder._capture_host = _capture_once
    spent = [0.0]

    def timed_finish(self, *args, **kwargs):
        t0 = time.perf_counter()
        finish(self, *args, **kwargs)
        spent[0] += time.perf_counter() - t0

    host_graph.HostSteps.finish = timed_finish
    runs = []
    try:
        total = PRESET.num_hidden_layers * PRESET.num_local_experts
        with OffloadedModel.load(path, device="cpu", dtype="float32", cpu_experts="auto", link_gbps=1.0,
                                 expert_cache_experts=max(1, int(total * cache_fraction)), cpu_threads=1) as rt:
            guard = rt.placer.guard
            guard.pin("all", longer=True)
            n = 16 + steps * repeats + 8
            dec = GraphedDecoder(rt, max_len=n, graphs=False, min_bucket=n)  # one bucket: one capture
            tok = int(dec.prefill(list(range(3, 19))).argmax())
            dec.graphs = True
            guard.pin(mode)
            tok = int(dec.decode(tok).argmax())  # the capture: its step function runs once
            for _ in range(repeats):
                spent[0] = 0.0
                t0 = time.perf_counter()
                for _ in range(steps):
                    tok = int(dec.decode(tok).argmax())
                wall = time.perf_counter() - t0
                runs.append((wall / steps, spent[0] / steps))
            host_steps = rt.cache.stats.host_steps
    finally:
        GraphedDecoder._capture_host, host_graph.HostSteps.finish = capture, finish
    return {"mode": mode, "steps": steps, "repeats": repeats, "host_steps": host_steps,
            "outside_ms": 1e3 * statistics.median(r[0] for r in runs),
            "bookkeeping_ms": 1e3 * statistics.median(r[1] for r in runs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=MODES, default="host")
    ap.add_argument("--cache-fraction", type=float, default=0.1408, help="expert cache, a fraction of all experts")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or not 0 < args.cache_fraction < 1:
        print("Error: --steps and --repeats must be at least 1 and --cache-fraction in (0, 1)", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as switched, tempfile.TemporaryDirectory(prefix="pdflash-bookkeeping-") as tmp:
        if args.mode == "host":  # the hits' fused kernel through Triton's CPU interpreter, for this run only
            for name in ("TRITON_INTERPRET", "PDFLASH_FUSED_EXPERTS"):
                switched.enter_context(_env(name, True))
        path = write_checkpoint(Path(tmp) / "m", PRESET, mxfp4=True, seed=3, progress=False)
        res = measure(path, args.mode, args.cache_fraction, args.steps, args.repeats)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"{res['mode']}: {res['outside_ms']:.3f} ms a step outside the graph, of which bookkeeping "
              f"{res['bookkeeping_ms']:.3f} ms (median of {res['repeats']} x {res['steps']} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
