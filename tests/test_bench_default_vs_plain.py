"""benchmarks/bench_default_vs_plain.py: its step breakdown, and one real run of both arms."""

import json

import pytest


@pytest.fixture(scope="module")
def dvp(load_script):
    return load_script("benchmarks/bench_default_vs_plain.py")


def test_step_breakdown_by_hand(dvp):
    spec = [
        {"step": 1, "block": 1, "shadow": 0, "step_ms": None, "draft_ms": 0.0, "verify_ms": 5.0},
        {"step": 2, "block": 1, "shadow": 4, "step_ms": 7.0, "draft_ms": 1.5, "verify_ms": 5.0},
        {"step": 3, "block": 4, "shadow": 0, "step_ms": 9.0, "draft_ms": 1.0, "verify_ms": 7.5},
        {"step": 4, "block": 4, "shadow": 0, "step_ms": 8.0, "draft_ms": 1.0, "verify_ms": 6.5},
    ]
    got = dvp.step_breakdown(spec)
    assert got["steps"] == 4 and got["shadow_probes"] == 1 and got["step_ms"] == pytest.approx(8.0)
    assert got["outside_ms"] == pytest.approx((0.5 + 0.5 + 0.5) / 3)  # the untimed first step left out
    assert got["per_block"] == {"1": {"steps": 1, "verify_ms": 5.0, "verify_median_ms": 5.0, "draft_ms": 1.5, "step_ms": 7.0},
                                "4": {"steps": 2, "verify_ms": 7.0, "verify_median_ms": 7.0, "draft_ms": 1.0, "step_ms": 8.5}}
    plain = [{"step": 0, "token": 3, "step_ms": None}, {"step": 1, "token": 4, "step_ms": 2.0},
             {"step": 2, "token": 5, "step_ms": 4.0}, {"step": 3, "token": 6, "step_ms": 12.0}]
    assert dvp.step_breakdown(plain) == {"steps": 4, "step_ms": 6.0, "step_median_ms": 4.0}  # one slow step moves the mean


def test_a_traced_run_of_both_arms(dvp, tmp_path):
    out = tmp_path / "dvp.json"
    assert dvp.main(["--repeats", "1", "--prompts", "1", "--max-new-tokens", "12", "--trace", "--warmup", "0",
                     "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["warmup"] == 0 and len(result["runs"]) == 1
    row = result["runs"][0]
    assert row["same_tokens"] and row["ratio"] > 0
    d, p = row["default_steps"], row["no_draft_steps"]
    assert p["steps"] == 12 and p["step_ms"] > 0
    assert d["steps"] == sum(row["block_histogram"].values()) and d["outside_ms"] >= 0
    assert sum(v["steps"] for v in d["per_block"].values()) == d["steps"] - 1


def test_warm_up_runs_are_left_out(dvp, monkeypatch, tmp_path):
    """--warmup N runs each command N times on the first prompt before the measured pairs, and
    reports none of them."""
    calls = []

    def fake_run(cmd):
        calls.append(cmd)
        return {"tokens_per_second": 10.0 if "--no-draft" in cmd else 12.0, "token_ids": [1, 2], "acceptance_length": 1.5}

    monkeypatch.setattr(dvp, "run", fake_run)
    out = tmp_path / "dvp.json"
    assert dvp.main(["--repeats", "1", "--prompts", "2", "--warmup", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["warmup"] == 2 and [r["prompt"] for r in result["runs"]] == list(dvp.PROMPTS[:2])
    assert len(calls) == 2 * 2 + 2 * 2  # warm-ups: 2 of each arm; then 2 prompts x 2 arms
    assert all(c[c.index("generate") + 1] == dvp.PROMPTS[0] for c in calls[:4])
    assert sum("--no-draft" in c for c in calls[:4]) == 2
    assert result["summary"]["median_ratio"] == 1.2
    with pytest.raises(SystemExit):
        dvp.main(["--warmup", "-1"])


def test_guard_summary_reads_the_arms_and_the_rates_that_ordered_them(dvp):
    report = {"link_gbps": 2.0, "cpu_experts": {"gbps": 1.9, "guard": {
        "arm": "host", "checks": 1, "trace": [{"arm": "off", "tokens": 1, "ms": 4.8, "counted": "settling"},
                                              {"arm": "all", "tokens": 1, "ms": 1.4, "counted": "switch"}]}}}
    assert dvp.guard_summary(report) == {"arms": ["off", "all"], "arm": "host", "checks": 1, "cpu_gbps": 1.9,
                                         "link_gbps": 2.0}
    assert dvp.guard_summary({"cpu_experts": {"guard": None}}) is None and dvp.guard_summary({}) is None
