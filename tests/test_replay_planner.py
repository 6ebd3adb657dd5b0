"""benchmarks/replay_planner.py and the replayed regime it runs (pdflash.draft.replay)."""

import json

import pytest

from pdflash.draft.replay import link_bound_run


def test_a_replay_runs_to_its_horizon_and_fixed_lengths_are_kept():
    r = link_bound_run(0.9, seed=1, horizon=20)
    assert r.tokens >= 20 and r.tokens - 8 < 20 and r.seconds > 0
    assert sum(acc + 1 for _, acc, _ in r.steps) == r.tokens
    fixed = link_bound_run(0.9, seed=1, horizon=20, fixed=4)
    assert {b for b, _, _ in fixed.steps} == {4} and not any(shadow for _, _, shadow in fixed.steps)
    assert len(link_bound_run(0.3, seed=2, steps=7).steps) == 7
    with pytest.raises(ValueError, match="steps or horizon"):
        link_bound_run(0.5, seed=0)


def test_replay_script_prints_every_arm_and_refuses_bad_input(load_script, capsys):
    mod = load_script("benchmarks/replay_planner.py")
    assert mod.main(["--seeds", "2", "--horizons", "16", "--acceptance", "0.9,0.3", "--fixed", "1,4",
                     "--variant", 'prev={"trial_from_plain": false}', "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["arm"], r["acceptance"]) for r in rows} == {(a, p) for a in ("auto", "prev", "B1", "B4") for p in (0.9, 0.3)}
    plain = [r for r in rows if r["arm"] == "B1"]  # plain decoding does not depend on acceptance
    assert plain[0]["mean_tokens_per_second"] == pytest.approx(plain[1]["mean_tokens_per_second"])
    assert mod.main(["--seeds", "1", "--horizons", "8", "--acceptance", "0.5"]) == 0
    assert "| 8 | auto |" in capsys.readouterr().out
    for bad in (["--acceptance", "1.5"], ["--fixed", "9"], ["--horizons", "x"], ["--variant", "v={bad"],
                ["--variant", "v=[1]"], ["--variant", 'v={"no_such_option": 1}', "--seeds", "1", "--horizons", "4"]):
        with pytest.raises(SystemExit) as exc:
            mod.main(bad)
        assert exc.value.code == 2, bad
        assert "error:" in capsys.readouterr().err
