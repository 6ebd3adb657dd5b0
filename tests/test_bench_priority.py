"""bench-priority on tiny synthetic models over the CPU simulated link: the arms measure what they
claim (flat fetches at band 2 with non-zero exposed fetch, resident never waits), arm switches never
hang, the CLI writes JSON + PNG with a verdict, bad input fails before any work."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pdflash import PdflashError
from pdflash.bench import config as bconfig, decision, priority
from pdflash.bench.budget import plan_budget
from pdflash.bench.config import PriorityConfig
from pdflash.bench.decision import make_decision, instrumentation_checks
from pdflash.bench.priority import run_priority_bench

LINK_GBPS = 0.05  # one tiny MXFP4 expert (6912 B) crosses in ~0.14 ms



@pytest.fixture
def pair(tiny_pair):
    return tiny_pair  # conftest.py: a tiny target and its draft


def config(pair, **kw) -> PriorityConfig:
    base = dict(model_dir=str(pair / "target"), draft_dir=str(pair / "draft"), device="cpu", link_gbps=LINK_GBPS,
                draft_acceptance=0.7, max_new_tokens=10, repetitions=2, n_prompts=1, warmup=0, timeline=False,
                expert_cache_fraction=0.5)
    base.update(kw)
    return PriorityConfig(**base)


def _env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


# -- the arms measure what they claim ------------------------------------------------------------
def test_flat_exposes_fetch_resident_never_waits(pair):
    # a fixed block length: every step drafts, so every run has route-ahead traffic to attribute
    # (with --block-size auto the planner may verify a short run's steps as plain decoding)
    res = run_priority_bench(config(pair, arms=("flat", "banded", "on-demand", "resident"), block_size=4))
    setup = res["setup"]
    by_arm = {a: [s for s in res["samples"] if s["arm"] == a] for a in res["config"]["arms"]}
    assert all(len(v) == 2 for v in by_arm.values())
    assert setup["allocated_experts"] == setup["total_experts"] == 32 and setup["budget_experts"] == 16
    expert = setup["expert_bytes"]

    for s in by_arm["flat"]:  # Blocker B: a flat run that misses shows its waits
        assert s["misses"] > 0 and s["exposed_fetch_s"] > 0
        assert s["exposed_fetch_s"] == pytest.approx(sum(s["exposed_fetch_by_band_s"].values()))
        assert s["exposed_fetch_s"] < s["wall_s"]
        assert s["bands"]["route-ahead"]["submitted"] == 0  # flat: nothing at band 1
        assert s["bands"]["background"]["submitted"] > 0
        assert s["route_ahead"]["priority"] == 2
    for s in by_arm["banded"]:
        assert s["bands"]["route-ahead"]["submitted"] > 0 and s["route_ahead"]["priority"] == 1
    for s in by_arm["resident"]:  # every expert was resident before the run: nothing to wait for
        assert s["misses"] == 0 and s["hits"] > 0 and s["hit_rate"] == 1.0
        assert s["exposed_fetch_total_s"] == 0.0 and s["exposed_fetch_s"] == 0.0
        assert s["bytes_moved"] == 0 and s["on_demand_stall_per_fetch_s"] is None  # no fetch: not measured
    for s in by_arm["on-demand"]:
        assert s["prefetch"]["issued"] == {}
        assert s["bands"]["route-ahead"]["submitted"] == s["bands"]["background"]["submitted"] == 0
        # every byte in the window came from one demand fetch of one whole expert
        assert s["bytes_moved"] == s["demand_fetches"] * expert > 0
        # the scheduler's blocked time is measured inside the cache's wait points
        assert s["bands"]["on-demand"]["stall_s"] <= s["exposed_fetch_by_band_s"]["on-demand"] + 1e-6
        assert s["on_demand_stall_per_fetch_s"] == pytest.approx(
            s["exposed_fetch_by_band_s"]["on-demand"] / s["waits_by_band"]["on-demand"])
        assert s["same_tokens_as_reference"] is True
    assert res["checks"]["exposed_fetch_instrumented"]["ok"]
    assert res["checks"]["resident_exposed_fetch_zero"]["ok"]
    # one reset_cache per run plus the reference run; the model was never closed in between
    assert setup["arm_switches"] == len(res["samples"]) + 1
    assert res["summary"]["resident"]["on_demand_stall_per_fetch_s"]["mean"] is None
    assert res["decision"]["verdict"] in decision.VERDICTS


def test_oracle_arm_replays_the_recorded_verify_experts(pair):
    res = run_priority_bench(config(pair, arms=("banded", "oracle"), repetitions=1))
    orc = next(s for s in res["samples"] if s["arm"] == "oracle")
    ra = orc["route_ahead"]
    assert ra["predictor"] == "oracle-replay" and ra["recall"] == 1.0 and ra["precision"] == 1.0
    assert res["checks"]["oracle_prediction_exact"]["ok"]
    assert res["decision"]["verdict"] == "unmeasurable"  # flat did not run
    assert "flat" in res["decision"]["reasons"][0]


# -- Blocker A: switching arms never hangs -------------------------------------------------------
SWITCH_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    from pdflash.bench.budget import plan_budget
    from pdflash.bench.config import ARMS, PriorityConfig
    from pdflash.bench.runner import PriorityBench
    cfg = PriorityConfig(model_dir=sys.argv[1], draft_dir=sys.argv[2], device="cpu", link_gbps=0.05,
                         draft_acceptance=0.7, max_new_tokens=4, n_prompts=1, timeline=False)
    cfg.validate()
    bench = PriorityBench(cfg, plan_budget(cfg), log=lambda m: None)
    bench.load()
    bench.prepare()
    out = []
    for i in range(20):
        arm = ARMS[i % len(ARMS)]
        s = bench.run_one(arm, 0)
        occ = bench.rt.cache.occupancy()
        out.append({"arm": arm, "tokens": s["tokens"], "misses": s["misses"], "slots": occ["slots"],
                    "closed": bench.rt._closed})
    bench.rt.close()
    print(json.dumps(out))
""")


def test_twenty_arm_switches_in_one_process_do_not_hang(pair):
    proc = subprocess.run([sys.executable, "-c", SWITCH_SCRIPT, str(pair / "target"), str(pair / "draft")],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(runs) == 20 and all(r["tokens"] == 4 and not r["closed"] for r in runs)
    for r in runs:  # the budget arms run on the capacity limit, the resident arm on every slot
        assert r["slots"] == (32 if r["arm"] == "resident" else 8)
        assert (r["misses"] == 0) == (r["arm"] == "resident")


# -- the whole command ---------------------------------------------------------------------------
def pdflash(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pdflash.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=_env())


def test_cli_run_writes_json_png_and_a_verdict(pair, tmp_path):
    out = tmp_path / "bm3.json"
    proc = pdflash("bench-priority", "--model", pair / "target", "--draft", pair / "draft", "--device", "cpu",
                   "--link-gbps", LINK_GBPS, "--draft-acceptance", "0.7", "--repetitions", "3", "--prompts", "2",
                   "--max-new-tokens", "12", "--expert-cache-fraction", "0.5", "--seed", "3", "--output", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["schema"] == priority.SCHEMA
    assert res["decision"]["verdict"] in decision.VERDICTS
    assert f"VERDICT: {res['decision']['verdict'].upper()}" in proc.stderr
    assert "verdict" in proc.stdout.lower() and "n/a" in proc.stdout  # resident has no on-demand fetch
    cfg = res["config"]
    assert cfg["arms"] == list(bconfig.ARMS) and cfg["repetitions"] == 3 and cfg["seed"] == 3
    assert len(cfg["arm_orders"]) == 3 and all(sorted(o) == sorted(bconfig.ARMS) for o in cfg["arm_orders"])
    assert len(res["samples"]) == 5 * 3 * 2
    assert {(s["arm"], s["repetition"], s["prompt"]) for s in res["samples"]} == {
        (a, r, p) for a in bconfig.ARMS for r in range(3) for p in range(2)}
    assert res["setup"]["arm_switches"] >= 20
    for key in ("cpu", "torch", "transformers", "gpu"):
        assert key in res["machine"]
    for arm in bconfig.ARMS:
        assert res["summary"][arm]["tokens_per_second"]["n"] == 6
        hist = res["summary"][arm]["block_histogram"]
        steps = sum(s["verify_steps"] for s in res["samples"] if s["arm"] == arm)
        assert sum(hist.values()) == steps and res["summary"][arm]["bytes_per_committed_token"]["n"] == 6
    assert res["setup"]["block_mode"] == "auto" and "Verify blocks" in proc.stdout
    assert set(res["summary"]["oracle"]["block_histogram"]) <= {"4", "3", "2", "1"}  # full blocks (the last may be shorter)
    assert res["summary"]["flat"]["planner_measured_step_ms"]["n"] == 6
    assert res["summary"]["resident"]["on_demand_stall_per_fetch_s"]["mean"] is None
    assert res["checks"]["resident_exposed_fetch_zero"]["ok"] and res["checks"]["exposed_fetch_instrumented"]["ok"]
    dec = res["decision"]
    if dec["verdict"] != "unmeasurable":
        assert len(dec["reasons"]) == 3 and dec["inputs"]["pairs"] == 6
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- bad input: one Error line, nothing written ----------------------------------------------------
def run_main(monkeypatch, capsys, *args) -> tuple[int, str]:
    from pdflash.cli import main as cli_main

    monkeypatch.setattr(sys, "argv", ["pdflash", *map(str, args)])
    with pytest.raises(SystemExit) as exc:
        cli_main.main()
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize("extra, want, message", [  # 2: bad usage; 1: does not fit the files / machine
    (("--arms", "flat,turbo"), 2, "unknown arm 'turbo'"),
    (("--dtype", "float8"), 2, "unknown dtype 'float8'"),
    (("--repetitions", "0"), 2, "--repetitions must be at least 1"),
    (("--output", "/nonexistent-dir/bm3.json"), 1, "cannot be written"),
    (("--predictor", "psychic"), 2, "unknown route-ahead predictor"),
    (("--draft-acceptance", "1.5"), 2, "--draft-acceptance must be between 0 and 1"),
])
def test_bad_input_is_one_error_line_before_any_work(pair, tmp_path, monkeypatch, capsys, extra, want, message):
    out = tmp_path / "bm3.json"
    args = ["bench-priority", "--model", pair / "target", "--draft", pair / "draft", "--device", "cpu", "--output", out]
    code, err = run_main(monkeypatch, capsys, *args, *extra)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == want and len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], err
    assert not out.exists()


def test_model_needs_its_draft_and_the_embedded_pair_is_the_default(pair, tmp_path, monkeypatch, capsys):
    code, err = run_main(monkeypatch, capsys, "bench-priority", "--model", pair / "target", "--output", tmp_path / "x.json")
    assert code == 2 and err.startswith("Error: give --draft DIR")
    code, err = run_main(monkeypatch, capsys, "bench-priority", "--draft", pair / "draft", "--output", tmp_path / "x.json")
    assert code == 2 and err.startswith("Error: --draft needs --model")
    # without either: the embedded pair, checked and sized before anything is loaded
    code, err = run_main(monkeypatch, capsys, "bench-priority", "--arms", "flat,nope", "--output", tmp_path / "x.json")
    assert code == 2 and "unknown arm 'nope'" in err
    from pdflash.offload.embedded import embedded_draft, embedded_target

    b = plan_budget(PriorityConfig(model_dir=str(embedded_target()), draft_dir=str(embedded_draft())))
    assert b.total_experts == b.num_layers * b.num_experts and b.budget_experts == round(0.25 * b.total_experts)


def test_missing_model_and_output_directory(pair, tmp_path, monkeypatch, capsys):
    code, err = run_main(monkeypatch, capsys, "bench-priority", "--model", tmp_path / "nope", "--draft", pair / "draft",
                         "--device", "cpu", "--output", tmp_path / "bm3.json")
    assert code == 1 and err.startswith("Error: --model") and "no such directory" in err
    code, err = run_main(monkeypatch, capsys, "bench-priority", "--model", pair / "target", "--draft", pair / "draft",
                         "--device", "cpu", "--output", tmp_path)
    assert code == 1 and "is a directory" in err


# -- the decision from samples -------------------------------------------------------------------
def _fake(arm, rep, prompt, exposed, tps, od, misses=10):
    return {"arm": arm, "repetition": rep, "prompt": prompt, "exposed_fetch_s": exposed, "tokens_per_second": tps,
            "on_demand_stall_per_fetch_s": od, "misses": misses, "exposed_fetch_total_s": exposed,
            "route_ahead": None, "same_tokens_as_reference": None, "oracle_refreshes": 0}


def test_decision_ships_only_on_a_clear_paired_win():
    samples = []
    for r in range(5):
        for p in range(2):
            jitter = 0.001 * ((r * 7 + p * 3) % 5)
            samples.append(_fake("flat", r, p, 0.050 + jitter, 20.0 + r * 0.1, 2e-4 + jitter * 1e-3))
            samples.append(_fake("banded", r, p, 0.030 + jitter, 20.1 + r * 0.1, 2e-4 + jitter * 1e-3))
    checks = instrumentation_checks(samples)
    dec, inputs = make_decision(samples, ("flat", "banded"), checks, seed=0)
    assert dec.verdict == "ship" and inputs["pairs"] == 10
    worse = [dict(s, exposed_fetch_s=s["exposed_fetch_s"] + (0.04 if s["arm"] == "banded" else 0)) for s in samples]
    assert make_decision(worse, ("flat", "banded"), instrumentation_checks(worse), seed=0)[0].verdict == "no-ship"


def test_decision_refuses_an_uninstrumented_zero():
    samples = [_fake(a, r, 0, 0.0, 20.0 + r, 2e-4 + r * 1e-6) for a in ("flat", "banded") for r in range(5)]
    checks = instrumentation_checks(samples)
    assert not checks["exposed_fetch_instrumented"]["ok"]
    dec, _ = make_decision(samples, ("flat", "banded"), checks, seed=0)
    assert dec.verdict == "unmeasurable" and "not instrumented" in dec.reasons[0]


def test_validate_rejects_before_loading(pair):
    for kw, message in [(dict(arms=()), "no arm"), (dict(arms=("flat", "flat")), "named twice"),
                        (dict(max_new_tokens=1), "at least 2"), (dict(n_prompts=99), "--prompts must be"),
                        (dict(link_gbps=-1.0), "--link-gbps must be between"), (dict(expert_cache_fraction=0.0), "(0, 1]")]:
        with pytest.raises(PdflashError, match=message.replace("(", r"\(").replace("]", r"\]")):
            config(pair, **kw).validate()
    with pytest.raises(PdflashError, match="a verify block of 4 tokens needs at least 8") as err:
        plan_budget(config(pair, expert_cache_fraction=0.1))
    fix = float(str(err.value).split("give at least --expert-cache-fraction ")[1].split(",")[0])
    assert plan_budget(config(pair, expert_cache_fraction=fix)).budget_experts >= 8  # the suggested size works


def test_figure_without_matplotlib_says_so(monkeypatch, tmp_path):
    from pdflash.bench import report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    why = report.write_figure({"config": {"arms": []}, "summary": {}}, tmp_path / "x.png")
    assert "matplotlib is not installed" in why and not (tmp_path / "x.png").exists()


def test_decode_window_opens_on_runtime_forwards_not_module_hooks(pair):
    """The graphed decoder replays segments that run no module hooks; the window must open on the
    runtime's own forward start, after the prompt's forwards (chunked or not)."""
    from pdflash.bench.runner import _DecodeWindow
    from pdflash.offload.runtime import OffloadedModel

    with OffloadedModel.load(pair / "target", device="cpu", expert_cache_experts=8) as rt:
        w = _DecodeWindow(rt, prompt_tokens=700, max_block=8)
        rt.begin_forward(512)  # the prompt in two chunks: no window yet
        rt.begin_forward(188)
        assert w.start is None
        rt.begin_forward(8)  # the first verify block
        assert w.start is not None and w.t_start is not None
        first = w.t_start
        rt.begin_forward(1)
        assert w.t_start == first
        w.close()
        rt.begin_forward(1)  # removed: no more calls
        assert w.seen == 709  # 512 + 188 + 8 + 1: the last one was not observed
