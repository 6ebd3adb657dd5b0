"""benchmarks/bench_speculation_gpu.py runs end to end on the CPU with the tiny pair (the GPU
command runs the same code on the gpt-oss-20b shape)."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_speculation_gpu.py"


def test_cpu_dry_run_writes_every_arm(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_speculation_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "spec.json"
    assert mod.main(["--preset", "tiny", "--device", "cpu", "--link-gbps", "2", "--checkpoint-dir", str(tmp_path / "ck"),
                     "--tokens", "10", "--prompts", "1", "--dtypes", "bfloat16,float32", "--acceptance", "0.9,0.3",
                     "--blocks", "2,8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["summary"]) == {"bfloat16", "float32"}
    arms = {"plain", "auto@0.9", "B2@0.9", "auto@0.3", "B2@0.3"}  # 8 exceeds the tiny draft's 4: dropped
    for dtype, s in res["summary"].items():
        assert set(s["arms"]) == arms and set(s["targets"]) == {"auto@0.9", "auto@0.3"}
        assert s["arms"]["plain"]["vs_plain"] == 1.0
    assert len(res["runs"]) == 2 * len(arms)
    for r in res["runs"]:
        assert r["same_tokens_as_plain"], r
        if r["arm"] != "plain":
            assert r["oracle_refreshes"] == 0 and r["same_tokens_as_reference"]
            assert sum(r["block_histogram"].values()) == r["verify_steps"]
        if r["arm"].startswith("auto"):
            assert "predicted_step_ms" in r["planner"]
    assert "target auto@0.9" in res["markdown"]
