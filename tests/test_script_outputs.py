"""The benchmark and check scripts' shared front door: an output folder that cannot be made is
refused before any work, in one line, with exit code 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["benchmarks/kernel_sweep.sh", "benchmarks/hybrid_gpu.sh sweep",
                                    "benchmarks/speculation_gpu.sh spec", "benchmarks/bench_priority_gpu.sh bench",
                                    "tools/gpu_check.sh"])
def test_an_output_folder_that_cannot_be_made_is_refused_in_one_line(tmp_path, script):
    """OUT naming a file (or a folder below one): exit 2 and one line saying so, before any work."""
    blocker = tmp_path / "a-file"
    blocker.write_text("kept\n")
    path, *stage = script.split()
    env = {**os.environ, "OUT": str(blocker / "out"), "WORK": str(tmp_path / "work"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / path), *stage], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"Error: cannot make the output folders (OUT={blocker / 'out'}"
        + ("" if "sweep" in script else f", WORK={tmp_path / 'work'}") + "): give writable folder paths"]
    assert blocker.read_text() == "kept\n"
