"""benchmarks/bench_speculation_gpu.py runs end to end on the CPU with the tiny pair (the GPU
command runs the same code on the gpt-oss-20b shape)."""

import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_speculation_gpu.py"


def test_cpu_dry_run_writes_every_arm(tmp_path, load_script):
    mod = load_script("benchmarks/bench_speculation_gpu.py")
    out = tmp_path / "spec.json"
    assert mod.main(["--preset", "tiny", "--device", "cpu", "--link-gbps", "2", "--checkpoint-dir", str(tmp_path / "ck"),
                     "--tokens", "10", "--prompts", "1", "--dtypes", "bfloat16,float32", "--acceptance", "0.9,0.3",
                     "--blocks", "2,8", "--probes", "shadow,real", "--no-retreat-arm", "--no-overdraft-arm",
                     "--margin-arm", "--no-trial-arm", "--previous-arm", "--trace",
                     "--variant", 'home={"first_by_cost": false}', "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["summary"]) == {"bfloat16", "float32"}
    autos = ("auto", "auto-real", "auto-noretreat", "auto-noover", "auto-m105", "auto-notrial", "auto-prev", "auto-home")
    arms = {"plain"} | {f"{a}@{p}" for a in autos + ("B2",) for p in ("0.9", "0.3")}  # 8 exceeds the tiny draft's 4
    for dtype, s in res["summary"].items():
        assert set(s["arms"]) == arms and set(s["targets"]) == {"auto@0.9", "auto@0.3"}
        assert s["arms"]["plain"]["vs_plain"] == 1.0
    assert len(res["runs"]) == 2 * len(arms)
    for r in res["runs"]:
        assert r["same_tokens_as_plain"], r
        if r["arm"] == "plain":  # the decode phase's bytes per token, below the run's with its prompt
            assert 0 < r["bytes_per_token"] <= r["run_bytes_per_token"], r
        if r["arm"] != "plain":
            assert r["oracle_refreshes"] == 0 and r["same_tokens_as_reference"]
            assert sum(r["block_histogram"].values()) == r["verify_steps"]
            assert r["draft_pass"] == "operators"  # graphed passes are for CUDA
        if r["arm"].startswith("auto"):
            assert "predicted_step_ms" in r["planner"]
            if r["arm"].startswith("auto-real"):
                assert r["planner"]["shadow_probes"] == 0
            assert r["planner"]["retreats"] >= 0
            assert len(r["planner"]["trace"]) == r["verify_steps"]  # --trace: one record per step
            if r["arm"].startswith("auto-notrial"):
                assert r["planner"]["trials"] == 0
            if r["arm"].startswith(("auto-noover", "auto-real")):  # nothing drafted past a verified block
                assert r["planner"]["overdrafted_blocks"] == 0
            assert "drafting_share" in r and "steady_plain_ms" in r
    assert "target auto@0.9" in res["markdown"]
    assert any(r["planner"]["overdrafted_blocks"] > 0 for r in res["runs"] if r["arm"].startswith("auto@"))
    with pytest.raises(SystemExit):
        mod.main(["--preset", "tiny", "--device", "cpu", "--checkpoint-dir", str(tmp_path / "ck"), "--probes", "fake",
                  "--out", str(out)])
    for bad in ("home", "home={", "home=[1]", "a@b={}"):
        with pytest.raises(SystemExit) as e:
            mod.main(["--preset", "tiny", "--device", "cpu", "--checkpoint-dir", str(tmp_path / "ck"), "--variant", bad,
                      "--out", str(out)])
        assert e.value.code == 2


def test_drafting_share_prices_drafted_steps_at_the_runs_plain_step(load_script):
    """Steady plain steps of 9 and 11 ms (median 10 ms; the first step follows none); a verified
    block committing 2 tokens in 15 ms gains 5 ms, a shadow probe (1 token in 13 ms) costs 3 ms:
    (-5 + 3) / 58 ms of run."""
    from types import SimpleNamespace as S

    mod = load_script("benchmarks/bench_speculation_gpu.py")

    def step(block, committed, draft, verify, shadow=0):
        return S(block_size=block, committed=[0] * committed, draft_seconds=draft, verify_seconds=verify,
                 shadow_block=shadow)

    steps = [step(1, 1, 0.0, 0.010), step(1, 1, 0.0, 0.009), step(1, 1, 0.0, 0.011), step(2, 2, 0.003, 0.012),
             step(1, 1, 0.003, 0.010, shadow=4)]
    assert mod.steady_plain_seconds(steps, least=2) == pytest.approx(0.010)  # steady: 9, 11 ms
    assert mod.drafting_share(steps, least=2) == pytest.approx((-0.005 + 0.003) / 0.058)
    assert mod.drafting_share(steps, least=3) is None  # too few steady plain steps to price the others by


def test_paired_bench_runs_every_arm_each_round_and_refuses_bad_arms(load_script, tiny_pair, tmp_path, capsys):
    """bench_paired.py: one runtime, every arm once a round on each prompt, ratios to plain
    decoding from the medians, lossless arms; a bad arm list is one clear error."""
    import pytest

    mod = load_script("benchmarks/bench_paired.py")
    out = tmp_path / "paired.json"
    rc = mod.main(["--model", str(tiny_pair / "target"), "--draft", str(tiny_pair / "draft"), "--arms", "plain,auto,block2,home",
                   "--variant", 'home={"first_by_cost": false}', "--rounds", "2", "--prompts", "2", "--max-new-tokens", "6",
                   "--expert-cache-experts", "12", "--link-gbps", "1", "--out", str(out)])
    assert rc == 0
    got = json.loads(out.read_text())
    assert got["arms"] == ["plain", "auto", "block2", "home"] and got["all_same_tokens"]
    assert got["variants"] == {"home": {"first_by_cost": False}}
    assert len(got["per_prompt"]) == 2
    for p in got["per_prompt"].values():
        assert all(len(v) == 2 for v in p["tokens_per_second"].values())
        assert p["ratio"]["block2"] == pytest.approx(p["median_tps"]["block2"] / p["median_tps"]["plain"])
    assert set(got["summary"]) == {"auto", "block2", "home"}
    for bad in ("auto,block2", "plain,fast", "plain,block0", "plain,plain"):
        with pytest.raises(SystemExit) as e:
            mod.main(["--arms", bad])
        assert e.value.code == 2
        assert "--arms" in capsys.readouterr().err
    for bad in ("home", "home={", "plain={}", "home=3"):
        with pytest.raises(SystemExit) as e:
            mod.main(["--arms", "plain,home", "--variant", bad])
        assert e.value.code == 2
        assert "--variant" in capsys.readouterr().err


def test_plain_step_benchmark_runs_every_arm_on_the_cpu(load_script, tmp_path):
    """benchmarks/bench_plain_step.py: every arm, its steady-step medians and ratios to plain."""
    mod = load_script("benchmarks/bench_plain_step.py")
    out = tmp_path / "plain_step.json"
    assert mod.main(["--preset", "tiny", "--device", "cpu", "--link-gbps", "2", "--checkpoint-dir", str(tmp_path / "ck"),
                     "--tokens", "16", "--prompts", "1", "--repeats", "2", "--acceptance", "0", "--profile",
                     "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["summary"]) == {"plain", "decoder", "decoder-rows", "loop", "auto@0.0"}
    assert len(res["runs"]) == 2 * 5
    for arm in ("plain", "decoder", "decoder-rows", "loop"):
        s = res["summary"][arm]
        assert s["runs"] == 2 and s["steady_wall_ms"] > 0 and s["steady_misses"] is not None
    assert {r["rows"] for r in res["runs"] if r["arm"] == "decoder"} == {None}
    assert {r["rows"] for r in res["runs"] if r["arm"] == "decoder-rows"} == {4}  # the tiny draft's block
    assert res["summary"]["plain"]["vs_plain"] == 1.0
    assert res["summary"]["loop"]["steady_loop_ms"] > 0 and res["summary"]["plain"]["steady_loop_ms"] is None
    assert set(res["profiles"]) == {"plain", "loop"} and "function calls" in res["profiles"]["loop"]
    for bad in (["--acceptance", "x"], ["--acceptance", "2"], ["--tokens", "3"], ["--prompts", "0"]):
        with pytest.raises(SystemExit):
            mod.main(["--preset", "tiny", "--device", "cpu", "--checkpoint-dir", str(tmp_path / "ck"),
                      "--out", str(out), *bad])


def test_plain_step_benchmark_takes_the_steady_plain_steps(load_script):
    mod = load_script("benchmarks/bench_plain_step.py")
    rows = [{"wall": w, "plain": p} for w, p in ((9, True), (1, True), (50, False), (70, True), (3, True), (5, True))]
    assert mod.steady(rows, "wall", skip=0) == 3  # 1, 3, 5: the steps after the drafted one and the first left out
    assert mod.steady(rows, "wall", skip=2) == 5
    assert mod.steady(rows, "wall", skip=3) is None


def test_draft_graphs_benchmark_compares_the_two_paths_on_the_cpu(load_script, tmp_path, capsys):
    """benchmarks/bench_draft_graphs.py: per block, both paths' median step, their ratio and
    agreement (on a CPU the static passes run eagerly, so they agree with the eager draft)."""
    mod = load_script("benchmarks/bench_draft_graphs.py")
    out = tmp_path / "draft_graphs.json"
    assert mod.main(["--preset", "tiny", "--device", "cpu", "--checkpoint-dir", str(tmp_path / "ck"),
                     "--steps", "3", "--blocks", "2,4,16", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["blocks"]) == {"2", "4"}  # 16 is over the tiny draft's trained block
    assert res["paths"]["static"] == res["paths_after"]["static"] == "static"
    for row in res["blocks"].values():
        assert row["eager_ms"] > 0 and row["static_ms"] > 0 and row["proposals_agree"]
        assert row["max_abs_diff"] < 1e-4
    assert mod.main(["--preset", "tiny", "--device", "cpu", "--checkpoint-dir", str(tmp_path / "ck"),
                     "--blocks", "two", "--out", str(out)]) == 2
    assert "--blocks" in capsys.readouterr().err


def test_cpu_experts_serve_every_arm_when_asked(tmp_path, load_script):
    """--cpu-experts all: plain and speculative arms compute their experts on the host's kernel,
    and float32 keeps every arm's tokens equal."""
    mod = load_script("benchmarks/bench_speculation_gpu.py")
    out = tmp_path / "spec.json"
    assert mod.main(["--preset", "tiny", "--device", "cpu", "--checkpoint-dir", str(tmp_path / "ck"), "--tokens", "8",
                     "--prompts", "1", "--dtypes", "float32", "--acceptance", "0.9", "--cpu-experts", "all",
                     "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["cpu_experts"] == "all"
    for r in res["runs"]:
        assert r["same_tokens_as_plain"] and r["cpu_experts_per_token"] > 0, r


def test_guard_arm_pins_every_arm_and_adds_a_fetch_only_plain_arm(tmp_path, capsys, load_script):
    """--guard-arm host: every arm but plain-fetch computes misses on the host's kernel, plain-fetch
    none; the summary compares every arm with plain-fetch too; --guard-arm without auto is refused."""
    mod = load_script("benchmarks/bench_speculation_gpu.py")
    out = tmp_path / "spec.json"
    assert mod.main(["--preset", "tiny", "--device", "cpu", "--checkpoint-dir", str(tmp_path / "ck"), "--tokens", "8",
                     "--prompts", "1", "--dtypes", "float32", "--acceptance", "0.9", "--blocks", "2",
                     "--link-gbps", "2", "--cpu-experts", "auto", "--guard-arm", "host", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    runs = {r["arm"]: r for r in res["runs"]}
    assert set(runs) == {"plain", "plain-fetch", "auto@0.9", "B2@0.9"}
    assert runs["plain-fetch"]["cpu_experts_per_token"] == 0  # fetch-only, its prefill too
    for arm in ("plain", "auto@0.9", "B2@0.9"):
        assert runs[arm]["cpu_experts_per_token"] > 0 and runs[arm]["same_tokens_as_plain"], arm
    arms = res["summary"]["float32"]["arms"]
    assert arms["plain-fetch"]["vs_plain_fetch"] == 1.0 and arms["auto@0.9"]["vs_plain_fetch"] > 0
    assert "plain-fetch" in res["markdown"]
    # --guard-arm guard: no pin; every speculative arm runs its own check from a fresh start
    assert mod.main(["--preset", "tiny", "--device", "cpu", "--checkpoint-dir", str(tmp_path / "ck"), "--tokens", "8",
                     "--prompts", "1", "--dtypes", "float32", "--acceptance", "0.9", "--blocks", "1",
                     "--link-gbps", "2", "--cpu-experts", "auto", "--guard-arm", "guard", "--out", str(out)]) == 0
    runs = {r["arm"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["auto@0.9"]["guard"]["arm"] in ("off", "all", "model", "host")
    assert runs["auto@0.9"]["same_tokens_as_plain"] and runs["plain-fetch"]["cpu_experts_per_token"] == 0
    with pytest.raises(SystemExit) as exc:
        mod.main(["--preset", "tiny", "--device", "cpu", "--checkpoint-dir", str(tmp_path / "ck"),
                  "--guard-arm", "host", "--out", str(out)])
    assert exc.value.code == 2 and "--guard-arm needs --cpu-experts auto" in capsys.readouterr().err


def test_the_gpu_stage_script_runs_its_hybrid_stage_on_the_cpu(tmp_path):
    """benchmarks/speculation_gpu.sh hybrid (CPU check: tiny preset, simulated link): one JSON per
    dtype with the fetch-only plain arm; the plain stage, one JSON per dtype; an unknown stage is
    refused with exit code 2."""
    import os
    import subprocess
    import sys

    script = SCRIPT.parent / "speculation_gpu.sh"
    env = {**os.environ, "PRESET": "tiny", "DEVICE": "cpu", "EXTRA": "--link-gbps 2", "TOKENS": "6", "PROMPTS": "1",
           "ACCEPT": "0.9", "BLOCKS": "2", "DTYPES": "float32", "PYTHON": sys.executable,
           "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work")}
    done = subprocess.run(["bash", str(script), "hybrid"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    res = json.loads((tmp_path / "out" / "hybrid_float32.json").read_text())
    assert res["config"]["guard_arm"] == "host" and {r["arm"] for r in res["runs"]} >= {"plain", "plain-fetch", "B2@0.9"}
    env.update(TOKENS="8", DTYPES="bfloat16")  # the plain stage: one JSON per dtype
    done = subprocess.run(["bash", str(script), "plain"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "decoder-rows" in json.loads((tmp_path / "out" / "plain_step_bfloat16.json").read_text())["summary"]
    bad = subprocess.run(["bash", str(script), "bogus"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "stage must be" in bad.stderr


def test_the_gpu_stage_script_times_the_embedded_loop_per_call_on_the_cpu(tmp_path):
    """benchmarks/speculation_gpu.sh calls (CPU check, the embedded pair): time_decode_calls.py's
    arms, then --no-draft and the default with SETS applied, one JSON each."""
    import os
    import subprocess
    import sys

    script = SCRIPT.parent / "speculation_gpu.sh"
    env = {**os.environ, "DEVICE": "cpu", "REPEATS": "1", "CALL_TOKENS": "3", "PYTHON": sys.executable,
           "SETS": "cpu_compute.CpuExpertRunner.prewake_us=1000", "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work")}
    done = subprocess.run(["bash", str(script), "calls"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    runs = json.loads((tmp_path / "out" / "calls.json").read_text())["runs"]
    assert sorted({r["arm"] for r in runs}) == ["auto", "bs1", "nd"] and len(runs) == 6  # 2 prompts x 3 arms
    sets = json.loads((tmp_path / "out" / "calls_sets.json").read_text())
    assert sets["args"]["set"] == ["cpu_compute.CpuExpertRunner.prewake_us=1000"] and len(sets["runs"]) == 4


def test_the_hybrid_gpu_script_runs_a_stage_on_the_cpu(tmp_path):
    """benchmarks/hybrid_gpu.sh 20b (CPU check: tiny preset in memory): the stage's JSON and log
    land under $OUT/20b, its status in $OUT/status.txt; the threads stage runs once per count
    (under $OUT/threads/t<N>); the kernel sweep's lands under $OUT/sweep; the hand-off stage says
    why it cannot run without CUDA, the llama
    stage why it cannot run without its source; no stage or an unknown one exits 2."""
    import os
    import subprocess
    import sys

    script = SCRIPT.parent / "hybrid_gpu.sh"
    env = {**os.environ, "DEVICE": "cpu", "PRESET_20B": "tiny", "MODES_20B": "off,all", "TOKENS_HYBRID": "4",
           "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(script), "20b"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    res = json.loads((tmp_path / "out" / "20b" / "hybrid.json").read_text())
    assert [r["asked"] for r in res["runs"]] == ["off", "all"] and all(r["tokens_per_second"] for r in res["runs"])
    assert (tmp_path / "out" / "status.txt").read_text().startswith("20b: status 0")
    env_t = {**env, "THREADS": "1,2", "MODES_THREADS": "all"}  # the thread-count stage: one run per count
    done = subprocess.run(["bash", str(script), "threads"], env=env_t, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    for n in (1, 2):
        run = json.loads((tmp_path / "out" / "threads" / f"t{n}" / "hybrid.json").read_text())["runs"][0]
        assert run["asked"] == "all" and run["cpu_threads"] == n
    assert "threads: status 0" in (tmp_path / "out" / "status.txt").read_text()
    import tarfile

    env_p = {**env_t, "THREADS": "1", "OUT": str(tmp_path / "packed"), "PRESET_20B": "none",  # PACK=1: one archive of the
             "PRESET_THREADS": "tiny", "CACHE_THREADS": "0.5"}  # stage folders; another shape for the thread stage
    done = subprocess.run(["bash", str(script), "threads"], env={**env_p, "PACK": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert sorted(q.name for q in (tmp_path / "packed").iterdir()) == ["stages.tgz", "status.txt"]
    with tarfile.open(tmp_path / "packed" / "stages.tgz") as tar:
        assert {"threads/t1/hybrid.json", "threads/t1/hybrid.log"} <= set(tar.getnames())
        res = json.load(tar.extractfile("threads/t1/hybrid.json"))
    assert res["cache_slots"] == 16  # CACHE_THREADS 0.5 of tiny's 4 layers x 8 experts
    # the kernel sweep's stage: its JSON lines under $OUT/sweep, its table in the stage's summary
    import stress_programs

    if stress_programs.COMPILER is not None:
        env_s = {**env, "SWEEP_THREADS": "1", "SWEEP_VARIANTS": "base PREFETCH_ROWS=4",
                 "SWEEP_ARGS": "--experts 8 --hidden 256 --inter 128 --calls 3", "CC": stress_programs.COMPILER}
        done = subprocess.run(["bash", str(script), "sweep"], env=env_s, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        rows = (tmp_path / "out" / "sweep" / "kernel_sweep.jsonl").read_text().splitlines()
        assert sorted({json.loads(r)["variant"] for r in rows}) == ["PREFETCH_ROWS=4", "base"] and len(rows) == 4
        assert "| PREFETCH_ROWS=4 | 1 |" in done.stdout
    # the peer's stage: without its llama.cpp source, its status and bench_llamacpp.sh's reason
    done = subprocess.run(["bash", str(script), "llama"], env={**env, "LLAMA_SRC": str(tmp_path / "no-source.tar.gz")},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "llama: status 2" in (tmp_path / "out" / "status.txt").read_text()
    assert "no llama.cpp source at" in (tmp_path / "out" / "llama" / "llama.log").read_text()
    import torch

    if not torch.cuda.is_available():  # the hand-off stage needs CUDA: its status and one-line reason
        done = subprocess.run(["bash", str(script), "handoff"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "handoff: status 2" in (tmp_path / "out" / "status.txt").read_text()
        assert "needs a CUDA device" in (tmp_path / "out" / "handoff" / "handoff.log").read_text()
    for args in ([], ["bogus"]):
        bad = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.startswith("Error:") and len(bad.stderr.splitlines()) == 1
