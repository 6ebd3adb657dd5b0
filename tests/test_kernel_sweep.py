"""benchmarks/kernel_sweep.sh / kernel_sweep.c: the CPU kernel rebuilt with other values of its
compile-time knobs, each build checked against the portable kernel, then timed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stress_programs

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "kernel_sweep.sh"

pytestmark = pytest.mark.skipif(stress_programs.COMPILER is None, reason="no C compiler")


def _run(tmp_path, variants: str, args: str = "--experts 8 --hidden 256 --inter 128 --calls 4"):
    env = {**os.environ, "OUT": str(tmp_path), "VARIANTS": variants, "THREADS": "1,2", "ARGS": args,
           "PYTHON": sys.executable, "CC": stress_programs.COMPILER}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)


def test_every_variant_is_checked_and_timed_twice_per_thread_count(tmp_path):
    done = _run(tmp_path, "base PREFETCH_ROWS=0 MX_SUPER=4,PREFETCH_ROWS=16,POOL_LINES=1 HUGE_PAGES=1 GRAB_FIRST=75,GRAB_MAX=16,GRAB_STREAM=0")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "kernel_sweep.jsonl").read_text().splitlines()]
    assert len(rows) == 5 * 2 * 2  # variants x passes x thread counts
    knobs = {(r["variant"], r["prefetch_rows"], r["mx_super"], r["pool_lines"], r["huge_pages"], r["grab_share"],
              r["grab_max"], r["grab_first"], r["grab_stream"]) for r in rows}
    assert knobs == {("base", 8, 8, 0, 0, 1, 64, 0, 1), ("PREFETCH_ROWS=0", 0, 8, 0, 0, 1, 64, 0, 1),
                     ("MX_SUPER=4,PREFETCH_ROWS=16,POOL_LINES=1", 16, 4, 1, 0, 1, 64, 0, 1),
                     ("HUGE_PAGES=1", 8, 8, 0, 1, 1, 64, 0, 1), ("GRAB_FIRST=75,GRAB_MAX=16,GRAB_STREAM=0", 8, 8, 0, 0, 1, 16, 75, 0)}
    assert [r["variant"] for r in rows if r["pass"] == 2 and r["threads"] == 1] == [
        "GRAB_FIRST=75,GRAB_MAX=16,GRAB_STREAM=0", "HUGE_PAGES=1", "MX_SUPER=4,PREFETCH_ROWS=16,POOL_LINES=1", "PREFETCH_ROWS=0",
        "base"]  # the second pass in reverse
    assert all(isinstance(r["anon_huge_mib"], (int, float)) for r in rows)  # what the huge pages came to (-1: unknown)
    for r in rows:
        assert r["max_error"] <= 1e-3 and r["expert_bytes"] == 2 * 128 * 8 * 17 + 256 * 4 * 17
        assert r["dram_gbps"] > 0 and r["one_ms"] > 0 and r["layer8_ms"] > 0
        parts = r["one_us"]  # a one-expert call taken apart: its phases fill most of its time
        assert set(parts) == {"setup", "gate_up", "handoff", "down", "finish", "last_join_gate_up", "last_join_down"}
        assert parts["gate_up"] > 0 and parts["down"] > 0 and min(parts.values()) >= 0
        assert 0.5 * 1e3 * r["one_ms"] < sum(parts[k] for k in ("setup", "gate_up", "handoff", "down", "finish")) < 1.5 * 1e3 * r["one_ms"]
    assert "| base | 1 |" in done.stdout


def test_bad_variants_and_options_are_refused(tmp_path):
    done = _run(tmp_path, "base FOO=3")
    assert done.returncode == 2 and "variant 'FOO=3'" in done.stderr
    done = _run(tmp_path, "base", args="--hidden 100")
    assert done.returncode == 1 and "multiples of 32" in done.stderr
