"""`pdflash smoke` as a script runs it: the console entry point, --json, the exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch


def test_smoke_json_passes_and_exits_zero():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pdflash.cli.main", "smoke", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    report = json.loads(proc.stdout)
    failed = [c for b in report["backends"] for c in b["checks"] if not c["ok"]]
    assert proc.returncode == 0, f"exit {proc.returncode}: {failed} {proc.stderr[-2000:]}"
    assert report["ok"] is True and not failed
    names = {c["name"] for c in report["backends"][0]["checks"]}
    assert "close wakes waiters and is terminal" in names
    close = next(c for c in report["backends"][0]["checks"] if c["name"].startswith("close"))
    assert "4 waiters blocked" in close["detail"] or close["detail"].startswith("not applicable")
    assert [b["backend"] for b in report["backends"]][: 1] == ["memcpy"]
    assert len(report["backends"]) == (2 if torch.cuda.is_available() else 1)


def test_smoke_exit_code_three_when_a_check_fails(run, monkeypatch):
    from pdflash.native import smoke as smoke_mod

    def broken(backend, device):
        return smoke_mod.Check("deliberately failing check", False, "injected by the test")

    monkeypatch.setattr(smoke_mod, "CHECKS", [smoke_mod.check_bytes, broken])
    code, out, err = run("smoke", "--json", "--cuda", "no")
    report = json.loads(out)
    assert code == 3 and report["ok"] is False
    assert [c["ok"] for c in report["backends"][0]["checks"]] == [True, False]


def test_device_takes_generates_spelling(run, monkeypatch):
    """--device as generate spells it: cpu checks the memcpy backend only; cuda / cuda:N / N ask for
    the cuda backend (refused in one line without a GPU); a --cuda that disagrees is refused."""
    from pdflash.cli.smoke import _cuda_of_device

    assert _cuda_of_device("auto", "no") == ("no", 0)
    assert _cuda_of_device("cuda:2", "auto") == ("yes", 2)
    assert _cuda_of_device("1", "yes") == ("yes", 1)
    assert _cuda_of_device("cpu", "auto") == ("no", 0)
    code, out, err = run("smoke", "--json", "--device", "cpu")
    assert code == 0 and [b["backend"] for b in json.loads(out)["backends"]] == ["memcpy"]
    for args, want in ((["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N"),
                       (["--device", "cpu", "--cuda", "yes"], "disagree"),
                       (["--device", "cuda:0", "--cuda", "no"], "disagree")):
        code, out, err = run("smoke", *args)
        assert code == 2 and want in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    if not torch.cuda.is_available():
        code, out, err = run("smoke", "--device", "cuda")
        assert code == 1 and "no CUDA device" in err and len(err.strip().splitlines()) == 1
