"""benchmarks/time_decode_calls.py: arms run in-process with the named calls timed, then unwrapped."""

import json

import pytest


@pytest.fixture
def tdc(load_script):
    return load_script("benchmarks/time_decode_calls.py")


def test_arms_are_timed_per_call_and_the_wrappers_come_off(tdc, tmp_path, capsys):
    from pdflash.draft.planner import BlockPlanner

    plan_draft = BlockPlanner.plan_draft
    out = tmp_path / "t.json"
    assert tdc.main(["--max-new-tokens", "4", "--repeats", "1", "--arms", "nd,auto", "--out", str(out),
                     "--calls", "planner.BlockPlanner.plan_draft,runtime.OffloadedModel.forward,nothing.Here,"
                     "speculative._ModuleTarget.verify,speculative._DecoderTarget.verify"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["arm"] for r in runs] == ["nd", "auto"]
    calls = {r["arm"]: {c["call"]: c["count"] for c in r["calls"]} for r in runs}
    assert calls["nd"]["runtime.OffloadedModel.forward"] >= 3 and "planner.BlockPlanner.plan_draft" not in calls["nd"]
    assert calls["auto"]["planner.BlockPlanner.plan_draft"] >= 1
    verify = {k: n for k, n in calls["auto"].items() if k.startswith("speculative._") and k.endswith("Target.verify")}
    per_length = {k: n for k, n in calls["auto"].items() if k.startswith("speculative._") and "Target.verify[T=" in k}
    assert len(verify) == 1 and per_length and sum(per_length.values()) == sum(verify.values())  # split by block length
    assert all(r["experts_per_token"]["cache"] > 0 for r in runs)
    assert BlockPlanner.plan_draft is plan_draft  # unwrapped after the runs
    assert "not found (not wrapped): nothing.Here" in capsys.readouterr().err


def test_an_unknown_arm_is_refused(tdc):
    with pytest.raises(SystemExit) as exc:
        tdc.main(["--arms", "nd,fast"])
    assert exc.value.code == 2
    assert tdc.arm_args("auto_off") == ["--cpu-experts", "off"]
