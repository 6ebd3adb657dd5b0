"""Where a `pdflash generate` run's decode time goes, per Python call: each arm runs in this
process with chosen methods wrapped in a timer, and every wrapped call's count and inclusive
wall time is reported (a call inside another wrapped call is counted in both). The calls of
SPLITS are also reported per label of their arguments (``graphs.GraphedDecoder._step_host[T=1,host]``:
the steps of one token in host mode).

    python benchmarks/time_decode_calls.py --device cuda --prompt "class Parser:" --prompt "Hello, my name is"
    python benchmarks/time_decode_calls.py --arms nd,bs1,auto,nd_off,auto_off --calls planner.BlockPlanner.plan_draft,...

Arms: ``nd`` (--no-draft), ``bs1`` (--block-size 1: the speculative loop without the planner),
``auto`` (the default), each with ``_off`` for ``--cpu-experts off``. Every arm runs once untimed
first (graph captures, caches). Calls are named ``module.Class.method`` or ``module.function``
after the last part of the module (``planner.BlockPlanner.plan_draft``); the default set is the
decode loop's own calls and the verify path's (CALLS). A wrapper costs about a microsecond a call,
so wrap the calls to compare, not every small one. Per run: tokens/s, the hybrid guard's arm and
the planner's block histogram from generate's JSON, and the calls by inclusive time.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import import_pdflash  # noqa: E402

import_pdflash()

MODULES = ("pdflash.draft.planner", "pdflash.draft.speculative", "pdflash.offload.graphs", "pdflash.offload.host_graph",
           "pdflash.offload.cpu_compute", "pdflash.offload.runtime", "pdflash.offload.cache", "pdflash.offload.cost")
SHORT = {m.rsplit(".", 1)[1]: m for m in MODULES}  # the names' first part (``planner``) -> its module
CALLS = (
    "speculative._DecoderTarget.verify", "speculative._ModuleTarget.verify", "speculative.accept_greedy",
    "speculative._sync", "speculative.RepeatIndex.repeating",
    "graphs.GraphedDecoder.decode", "graphs.GraphedDecoder._step_host", "graphs.GraphedDecoder._features",
    "host_graph.HostSteps.before_step", "host_graph.HostSteps.sync_cache", "host_graph.HostSteps.refresh_plan",
    "host_graph.HostSteps.replay", "host_graph.HostSteps.finish",
    "cpu_compute.CpuExpertRunner.prewake", "cpu_compute.CpuExpertRunner.use_threads", "cpu_compute.HybridGuard.on_forward",
    "runtime.OffloadedModel._on_routed", "runtime.OffloadedModel.begin_forward", "runtime.OffloadedModel.forward",
    "planner.BlockPlanner.begin_step", "planner.BlockPlanner.plan_draft", "planner.BlockPlanner.end_step",
    "planner.BlockPlanner.on_routed", "planner.BlockPlanner.decide_plain",
)
ARMS = {"nd": ["--no-draft"], "bs1": ["--block-size", "1"], "auto": []}
# Calls also timed per label of their arguments (a step's token count and host mode): a wrapped
# call adds its time to "name" and to "name[label]".
SPLITS = {
    "graphs.GraphedDecoder.forward": lambda a, k: f"T={len(a[1])}",
    "graphs.GraphedDecoder._step_graphed": lambda a, k: f"T={len(a[1])}",
    "graphs.GraphedDecoder._step_host": lambda a, k: f"T={a[3]},{a[4] if len(a) > 4 else k.get('mode', 'all')}",
    "host_graph.HostSteps.before_step": lambda a, k: f"{a[1]},T={a[3]}",
    "speculative._DecoderTarget.verify": lambda a, k: f"T={len(a[1])}",
    "speculative._ModuleTarget.verify": lambda a, k: f"T={len(a[1])}",
}


class CallTimer:
    """Wraps the named calls of MODULES; ``totals`` maps a name to [calls, seconds]."""

    def __init__(self, names):
        self.names = set(names)
        self.totals: dict[str, list] = {}
        self._undo = []
        found = set()
        for short, modname in SHORT.items():
            mod = importlib.import_module(modname)
            for name, obj in list(vars(mod).items()):
                if inspect.isclass(obj) and obj.__module__ == modname:
                    for meth, fn in list(vars(obj).items()):
                        key = f"{short}.{name}.{meth}"
                        if key in self.names and inspect.isfunction(fn):
                            self._wrap(obj, meth, fn, key)
                            found.add(key)
                elif inspect.isfunction(obj) and obj.__module__ == modname and f"{short}.{name}" in self.names:
                    self._wrap(mod, name, obj, f"{short}.{name}")
                    found.add(f"{short}.{name}")
        self.missing = sorted(self.names - found)

    def _wrap(self, owner, attr, fn, key):
        totals = self.totals
        split = SPLITS.get(key)

        def label(args, kwargs) -> str:  # a call made another way than SPLITS expects is still timed
            try:
                return split(args, kwargs)
            except (IndexError, TypeError, AttributeError):
                return "?"

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - t0
                for name in (key, f"{key}[{label(args, kwargs)}]") if split else (key,):
                    entry = totals.setdefault(name, [0, 0.0])
                    entry[0] += 1
                    entry[1] += seconds

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn))

    def close(self) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()


def apply_sets(items: list[str]) -> list[tuple]:
    """``module.Class.attr=value`` (module as in CALLS, value a Python literal) set on the class for
    every arm of this run -> [(class, attr, old value)] to restore. Every item is checked before
    any is set. For a variant's A/B in two runs of this script."""
    import ast

    todo = []
    for item in items:
        name, eq, value = item.partition("=")
        parts = name.split(".")
        if not eq or len(parts) != 3:
            raise ValueError(f"--set {item!r}: give module.Class.attr=value")
        mod = SHORT.get(parts[0])
        owner = getattr(importlib.import_module(mod), parts[1], None) if mod else None
        if owner is None or not hasattr(owner, parts[2]):
            raise ValueError(f"--set {item!r}: no {parts[1]}.{parts[2]} in a module of {', '.join(MODULES)}")
        try:
            todo.append((owner, parts[2], ast.literal_eval(value)))
        except (ValueError, SyntaxError):
            raise ValueError(f"--set {item!r}: the value is not a Python literal") from None
    undo = []
    for owner, attr, new in todo:
        undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)
    return undo


def arm_args(name: str) -> list[str]:
    base, _, off = name.partition("_")
    if base not in ARMS or off not in ("", "off"):
        raise ValueError(f"unknown arm {name!r}: one of {', '.join(ARMS)}, each optionally with _off")
    return ARMS[base] + (["--cpu-experts", "off"] if off else [])


def generate(argv: list[str]) -> dict:
    """`pdflash generate ... --json` in this process -> its JSON (a failed run raises)."""
    from pdflash.cli.main import main

    old, sys.argv = sys.argv, ["pdflash", "generate", *argv, "--json"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            try:
                main()
            except SystemExit as exc:
                if exc.code:
                    raise RuntimeError(f"generate {' '.join(argv)} exited with {exc.code}") from None
    finally:
        sys.argv = old
    return json.loads(out.getvalue())


def _runs(args, arms: dict[str, list[str]]) -> list[dict]:
    """Every arm once untimed, then every prompt x repeat x arm with the calls timed."""
    prompts = args.prompt or ["class Parser:"]
    common = ["--max-new-tokens", str(args.max_new_tokens), "--device", args.device, *args.setting.split()]
    for extra in arms.values():  # untimed: captures and caches
        generate([prompts[0], *common, *extra])
    timer = CallTimer(c for c in args.calls.split(",") if c)
    if timer.missing:
        print(f"not found (not wrapped): {', '.join(timer.missing)}", file=sys.stderr)
    runs = []
    try:
        for prompt in prompts:
            for rep in range(args.repeats):
                for name, extra in arms.items():
                    timer.totals.clear()
                    got = generate([prompt, *common, *extra])
                    calls = sorted(((k, n, s) for k, (n, s) in timer.totals.items()), key=lambda x: -x[2])
                    guard = (got.get("cpu_experts") or {}).get("guard") or {}
                    planner = got.get("planner") or {}
                    run = {"prompt": prompt, "repeat": rep, "arm": name, "tokens_per_second": got["tokens_per_second"],
                           "generated_tokens": got["generated_tokens"], "guard_arm": guard.get("arm"),
                           "block_histogram": planner.get("block_histogram"),
                           "placing_steps": planner.get("placing_steps"),
                           "experts_per_token": got.get("experts_per_token"),
                           "cache_hit_rate": (got.get("cache") or {}).get("hit_rate"),
                           "calls": [{"call": k, "count": n, "ms": 1e3 * s, "ms_per_call": 1e3 * s / n} for k, n, s in calls]}
                    runs.append(run)
                    per = run["experts_per_token"] or {}
                    print(f"{prompt[:24]!r} {name} rep {rep}: {run['tokens_per_second']:.1f} tok/s, guard arm "
                          f"{run['guard_arm']}, blocks {run['block_histogram']}, experts a token "
                          + ", ".join(f"{k} {v:.1f}" for k, v in per.items() if v is not None), flush=True)
                    for c in run["calls"][: args.show]:
                        print(f"    {c['call']:48s} {c['count']:5d} x {c['ms_per_call']:.4f} ms = {c['ms']:.2f} ms", flush=True)
    finally:
        timer.close()
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", action="append", default=None, help="Repeatable (default: 'class Parser:').")
    ap.add_argument("--arms", default="nd,bs1,auto")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--calls", default=",".join(CALLS), help="Comma-separated calls to wrap.")
    ap.add_argument("--setting", default="--expert-cache-experts 64 --link-gbps 2",
                    help="generate's options for every arm (default: the `make demo` setting).")
    ap.add_argument("--set", action="append", default=[], metavar="module.Class.attr=value",
                    help="Repeatable: a class attribute set for every arm (e.g. cpu_compute.CpuExpertRunner.prewake_us=2000).")
    ap.add_argument("--show", type=int, default=12, help="Calls printed per run (by inclusive time).")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        arms = {name: arm_args(name) for name in args.arms.split(",")}
    except ValueError as exc:
        ap.error(str(exc))
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    try:
        undo = apply_sets(args.set)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        runs = _runs(args, arms)
    finally:
        for owner, attr, old in reversed(undo):
            setattr(owner, attr, old)
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
