"""The llama.cpp peer's GGUF writer (benchmarks/llamacpp_gguf.py) and its device script: sizes
from pdflash's own presets, bad input as one line and exit 2; a written file read back where the
gguf package is installed (it is not a pdflash dependency)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WRITER = ROOT / "benchmarks" / "llamacpp_gguf.py"
SCRIPT = ROOT / "benchmarks" / "bench_llamacpp.sh"


def writer(*args):
    return subprocess.run([sys.executable, str(WRITER), *args], capture_output=True, text=True, timeout=300)


def test_plan_sizes_follow_the_presets():
    q = json.loads(writer("--preset", "qwen3-30b-a3b", "--plan").stdout)
    assert (q["arch"], q["n_layer"], q["n_expert"], q["n_expert_used"]) == ("qwen3moe", 48, 128, 8)
    assert q["expert_bytes_per_layer"] == 128 * 3 * 2048 * 768 * 2  # gate, up, down in bf16
    by = {int(k): v for k, v in q["gpu_weight_bytes_by_ncmoe"].items()}
    assert by[0] - by[48] == q["expert_bytes"] == 48 * q["expert_bytes_per_layer"]
    g = json.loads(writer("--preset", "gpt-oss-120b", "--plan").stdout)
    assert (g["arch"], g["n_layer"], g["n_expert"], g["n_expert_used"], g["file_type"]) == ("gpt-oss", 36, 128, 4, "MOSTLY_MXFP4_MOE")
    # MXFP4 experts: 17 bytes per 32 weights (16 of nibbles, one E8M0 scale), biases in float32
    weights = 128 * (2 * 2880 * 2880 + 2880 * 2880)
    assert g["expert_bytes_per_layer"] == weights // 32 * 17 + 128 * (2 * 2880 + 2880) * 4


@pytest.mark.parametrize("args, message", [
    (("--preset", "nope", "--plan"), "unknown preset 'nope'"),
    (("--preset", "tiny", "--out", "/nonexistent/dir/x.gguf"), "cannot be written"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    r = writer(*args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_device_script_parses_and_refuses_unknown_arguments():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    r = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "unknown argument: --bogus" in r.stderr


def test_written_tiny_gguf_reads_back(tmp_path):
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "tiny.gguf"
    r = writer("--preset", "qwen3-tiny", "--out", str(out), "--seed", "1")
    assert r.returncode == 0, r.stderr
    plan = json.loads(writer("--preset", "qwen3-tiny", "--plan").stdout)
    reader = gguf.GGUFReader(str(out))
    names = {t.name for t in reader.tensors}
    assert len(reader.tensors) == plan["n_tensors"]
    assert {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight", "token_embd.weight"} <= names
    assert sum(int(t.n_bytes) for t in reader.tensors) == plan["tensor_bytes"]
