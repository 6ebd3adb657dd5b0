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
