"""benchmarks/time_decode_calls.py: arms run in-process with the named calls timed, then unwrapped."""

import json

import pytest


@pytest.fixture
def tdc(load_script):
    return load_script("benchmarks/time_decode_calls.py")


def test_arms_are_timed_per_call_and_the_wrappers_come_off(tdc, tmp_path, capsys):
    from pdflash.draft.planner import BlockPlanner

    decide_plain = BlockPlanner.decide_plain
    out = tmp_path / "t.json"
    assert tdc.main(["--max-new-tokens", "4", "--repeats", "1", "--arms", "nd,auto", "--out", str(out),
                     "--calls", "planner.BlockPlanner.decide_plain,runtime.OffloadedModel.forward,nothing.Here,"
                     "speculative._ModuleTarget.verify,speculative._DecoderTarget.verify"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["arm"] for r in runs] == ["nd", "auto"]
    calls = {r["arm"]: {c["call"]: c["count"] for c in r["calls"]} for r in runs}
    assert calls["nd"]["runtime.OffloadedModel.forward"] >= 3 and "planner.BlockPlanner.decide_plain" not in calls["nd"]
    assert calls["auto"]["planner.BlockPlanner.decide_plain"] >= 1  # asked before every step
    verify = {k: n for k, n in calls["auto"].items() if k.startswith("speculative._") and k.endswith("Target.verify")}
    per_length = {k: n for k, n in calls["auto"].items() if k.startswith("speculative._") and "Target.verify[T=" in k}
    assert len(verify) == 1 and per_length and sum(per_length.values()) == sum(verify.values())  # split by block length
    assert all(r["experts_per_token"]["cache"] > 0 for r in runs)
    assert BlockPlanner.decide_plain is decide_plain  # unwrapped after the runs
    assert "not found (not wrapped): nothing.Here" in capsys.readouterr().err


def test_an_unknown_arm_is_refused(tdc):
    with pytest.raises(SystemExit) as exc:
        tdc.main(["--arms", "nd,fast"])
    assert exc.value.code == 2
    assert tdc.arm_args("auto_off") == ["--cpu-experts", "off"]


def test_set_changes_a_class_attribute_for_the_run_and_restores_it(tdc, tmp_path, monkeypatch):
    from pdflash.draft.planner import BlockPlanner

    seen = []

    def spy(argv):  # what generate's JSON needs to hold for the report
        seen.append(BlockPlanner.shadow_every_probe)
        return {"tokens_per_second": 1.0, "generated_tokens": 2}

    monkeypatch.setattr(BlockPlanner, "shadow_every_probe", 3, raising=False)
    monkeypatch.setattr(tdc, "generate", spy)
    assert tdc.main(["--max-new-tokens", "2", "--repeats", "1", "--arms", "nd",
                     "--set", "planner.BlockPlanner.shadow_every_probe=7", "--calls", ""]) == 0
    assert seen and all(v == 7 for v in seen)  # the warm-up's run and the timed one
    assert BlockPlanner.shadow_every_probe == 3  # restored


@pytest.mark.parametrize("item", ["planner.BlockPlanner.no_such_attr=1", "planner.BlockPlanner=1",
                                  "nowhere.X.y=1", "planner.BlockPlanner.shadow_every_probe=not a literal"])
def test_a_wrong_set_is_refused_before_anything_runs(tdc, item, monkeypatch):
    from pdflash.draft.planner import BlockPlanner

    monkeypatch.setattr(BlockPlanner, "shadow_every_probe", 3, raising=False)
    monkeypatch.setattr(tdc, "generate", lambda argv: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exc:
        tdc.main(["--arms", "nd", "--set", "planner.BlockPlanner.shadow_every_probe=5", "--set", item])
    assert exc.value.code == 2
    assert BlockPlanner.shadow_every_probe == 3  # nothing set
