"""check_hybrid_gpu.py's runs under variants of the runtime's knobs, one after another in one
process: where a split host step's time goes, and what the scheduler's workers and the kernel's
threads do to it.

    python benchmarks/hybrid_variants.py VARIANTS OUTDIR [check_hybrid_gpu.py options...]
    python benchmarks/hybrid_variants.py auto-host:t12,auto-model:t12,auto-model:t12:zero:nofill,off:w4 \\
        out/ --in-memory gpt-oss-20b --device cuda --cuda-graphs --dtypes bfloat16 --tokens 48

A variant is ``MODE[:OPTION...]``: MODE one of check_hybrid_gpu.py's modes, OPTIONs among
``tN`` (``--cpu-threads N``), ``wN`` (``--workers N``), ``cX`` (``--chunk-mib X``),
``zero`` (split steps whose plan fetches nothing and no route-ahead: the split's own structure
with an idle link; use with mode auto-model-noahead or auto-model), ``nofill`` (no background
fills of the CPU's hot experts), ``libattn`` (the library's attention modules in the graphs instead
of the fused layer, offload/attn_triton.py: PDFLASH_FUSED_ATTENTION=0), ``resops`` (a host step's
expert rows summed into the residual stream by torch ops instead of host_graph.moe_residual's one
kernel: PDFLASH_FUSED_RESIDUAL=0). Each variant's JSON is OUTDIR/<variant, ':' as '_'>.json (a
variant named again, a repeat, adds _2, _3, ...); one
line per variant goes to stderr with its link rate and the cost model's CPU rate. Exit status 0,
2 for a malformed variant.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_hybrid_gpu as chk  # noqa: E402 (imports pdflash from this checkout)

from pdflash.offload.cpu_compute import CpuPlacement  # noqa: E402

_SWITCHES = {"libattn": "PDFLASH_FUSED_ATTENTION", "resops": "PDFLASH_FUSED_RESIDUAL"}  # option -> the switch it sets to 0


def parse(variant: str) -> tuple[str, list[str], bool, bool, list[str]]:
    """``MODE:OPTION...`` -> (mode, extra check_hybrid_gpu.py args, zero, nofill, the fused
    paths switched off: environment variables)."""
    mode, *opts = variant.split(":")
    extra, zero, nofill, off = [], False, False, []
    for o in opts:
        try:
            if o in _SWITCHES:
                off.append(_SWITCHES[o])
            elif o == "zero":
                zero = True
            elif o == "nofill":
                nofill = True
            elif o[:1] == "t" and int(o[1:]) >= 1:
                extra += ["--cpu-threads", o[1:]]
            elif o[:1] == "w" and int(o[1:]) >= 1:
                extra += ["--workers", o[1:]]
            elif o[:1] == "c" and float(o[1:]) > 0:
                extra += ["--chunk-mib", o[1:]]
            else:
                raise ValueError
        except ValueError:
            raise SystemExit(f"Error: variant {variant!r}: unknown option {o!r} "
                             f"(use tN, wN, cX, zero, nofill, {', '.join(_SWITCHES)})") from None
    return mode, extra, zero, nofill, off


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print("Error: give VARIANTS and OUTDIR, then check_hybrid_gpu.py's options (see --help of this file's docstring)",
              file=sys.stderr)
        return 2
    try:
        variants = [parse(v) + (v,) for v in argv[0].split(",")]
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    plan0, note0 = CpuPlacement.split_plan, CpuPlacement.note_host

    def zero_plan(self, *a, **k):
        plan, _ = plan0(self, *a, **k)
        return [0] * len(plan), 0

    seen: dict[str, int] = {}
    try:
        for mode, extra, zero, nofill, off, name in variants:
            CpuPlacement.split_plan = zero_plan if zero else plan0
            CpuPlacement.note_host = (lambda self, *a, **k: None) if nofill else note0
            seen[name] = seen.get(name, 0) + 1  # a variant named again (a repeat) gets its own file
            path = out / f"{name.replace(':', '_')}{'' if seen[name] == 1 else f'_{seen[name]}'}.json"
            print(f"== {name}", file=sys.stderr, flush=True)
            with contextlib.ExitStack() as switched:
                for name_off in off:
                    switched.enter_context(chk._env(name_off, False))
                rc = chk.main(argv[2:] + extra + ["--modes", mode, "--out", str(path)])
            if rc:
                return rc
            for r in json.loads(path.read_text())["runs"]:
                cm = r["cost_model"]
                cpu = cm.get("host_expert_ms")
                print(f"   link {cm['link_bytes_per_s'] / 1e9:.1f} GB/s, CPU "
                      f"{'-' if cpu is None else f'{cpu:.3f} ms'} an expert (cost model)", file=sys.stderr)
    finally:
        CpuPlacement.split_plan, CpuPlacement.note_host = plan0, note0
    return 0


if __name__ == "__main__":
    sys.exit(main())
