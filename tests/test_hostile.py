"""Hostile but realistic use: every bad value, broken input and fault is one line and the documented
exit code, nothing is destroyed or left behind, nothing hangs, and Ctrl-C keeps what was done.

Exit codes (README): 2 bad usage (the command line itself is wrong), 1 an error found while running,
130 interrupted. Faults are injected: a filesystem that reports little free space, a writer that fails
with ENOSPC, a read-only filesystem, a socket that accepts connections and never answers, SIGINT sent
to a subprocess.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdflash.draft import write_synthetic_draft
from pdflash.offload.config import ModelPreset
from pdflash.offload.synthetic import write_checkpoint

TINY = ModelPreset.from_name("tiny")
PROMPT = "The router keeps the best experts for every token"
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    write_checkpoint(root / "target", TINY, seed=3, mxfp4=True)
    write_synthetic_draft(root / "draft", "tiny", target_dir=root / "target", seed=4)
    return root


def one_error_line(code: int, err: str, want_code: int) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == want_code, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    return lines[0]


# -- bad usage: exit 2, one line, before anything is loaded ------------------------------------------
T, D = "{target}", "{draft}"  # placeholders for the fixture's directories
GEN = ("generate", PROMPT, "--model", T)
BENCH = ("bench-priority", "--model", T, "--draft", D, "--device", "cpu", "--output", "{tmp}/bm3.json")

USAGE_CASES = [
    (GEN + ("--max-new-tokens", "0"), "--max-new-tokens"),
    (GEN + ("--bogus",), "No such option: --bogus"),
    (("generate",), "Missing argument"),
    (("no-such-command",), "No such command"),
    (GEN + ("--expert-cache-mib", "nan"), "--expert-cache-mib must be a finite number"),
    (GEN + ("--expert-cache-mib", "inf"), "--expert-cache-mib must be a finite number"),
    (GEN + ("--expert-cache-mib", "-1"), "--expert-cache-mib must be at least 0"),
    (GEN + ("--expert-cache-mib", "1", "--expert-cache-experts", "4"), "not both"),
    (GEN + ("--temperature", "0.5", "--seed", str(2**64)), "--seed must be between 0 and 2**63-1"),
    (GEN + ("--seed", "-1"), "--seed must be between"),
    (GEN + ("--temperature", "nan"), "--temperature"),
    (GEN + ("--link-gbps", "nan"), "--link-gbps must be between"),
    (GEN + ("--link-gbps", "1e-300"), "--link-gbps must be between"),
    (GEN + ("--link-gbps", "0"), "--link-gbps must be between"),
    (GEN + ("--device", "foo"), "--device must be"),
    (GEN + ("--dtype", "float8"), "--dtype must be one of"),
    (GEN + ("--eviction", "fifo"), "--eviction must be one of"),
    (GEN + ("--draft", D, "--no-draft"), "--draft and --no-draft contradict"),
    (("generate", PROMPT, "--draft", D, "--no-draft"), "--draft and --no-draft contradict"),
    (GEN + ("--draft", D, "--block-size", "0"), "--block-size must be at least 1"),
    (GEN + ("--draft", D, "--block-size", "-1"), "--block-size must be at least 1"),
    (GEN + ("--cpu-threads", "100000"), "--cpu-threads must be between 1 and 256"),
    (GEN + ("--draft", D, "--block-size", "2.5"), "--block-size must be auto or a whole number"),
    (GEN + ("--block-size", "2"), "--block-size only applies to speculative decoding"),
    (GEN + ("--draft", D, "--draft-acceptance", "1.5"), "--draft-acceptance must be between 0 and 1"),
    (GEN + ("--draft", D, "--route-ahead-predictor", "psychic"), "unknown route-ahead predictor"),
    (BENCH + ("--repetitions", "0"), "--repetitions must be at least 1"),
    (BENCH + ("--block-size", "0"), "--block-size must be at least 1"),
    (BENCH + ("--link-gbps", "nan"), "--link-gbps must be between"),
    (BENCH + ("--link-gbps", "0"), "--link-gbps must be between"),
    (BENCH + ("--device", "foo"), "--device must be cpu, cuda or cuda:N"),
    (BENCH + ("--draft-acceptance", "1.5"), "--draft-acceptance must be between 0 and 1"),
    (BENCH + ("--expert-cache-fraction", "nan"), "--expert-cache-fraction must be in (0, 1]"),
    (("bench-priority", "--model", T, "--output", "{tmp}/bm3.json"), "give --draft DIR"),
    (("smoke", "--cuda", "maybe"), "--cuda must be auto, yes or no"),
    (("build-native", "--sanitize", "bogus"), "unknown sanitizer"),
    (("make-synthetic", "{tmp}/new", "--shard-mib", "0"), "--shard-mib must be at least 1"),
    (("make-synthetic", "{tmp}/new", "--preset", "bogus"), "unknown preset 'bogus'"),
    (("make-synthetic", "{tmp}/new", "--dtype", "int8"), "--dtype must be one of"),
    (("make-synthetic", "{tmp}/new", "--draft-preset", "bogus"), "unknown draft preset"),
    (("make-synthetic", "{tmp}/new", "--layers", "0"), "--layers must be at least 1"),
    (("make-synthetic", "{tmp}/new", "--draft-block-size", "8"), "--draft-block-size applies to the draft"),
    (("make-synthetic", "{tmp}/new", "--draft-preset", "tiny", "--draft-block-size", "1"), "--draft-block-size must be at least 2"),
    (("make-synthetic", "{tmp}/new", "--draft-layers", "2"), "--draft-layers applies to the draft"),
    (("make-synthetic", "{tmp}/new", "--draft-preset", "tiny", "--draft-layers", "0"), "--draft-layers must be at least 1"),
    (("make-synthetic", "{tmp}/new", "--draft-preset", "tiny", "--draft-intermediate", "-4"), "--draft-intermediate must be at least 1"),
    (("make-synthetic", "{tmp}/new", "--experts", "1"), "--experts must be at least 2"),
    (("make-synthetic", "{tmp}/new", "--vocab", "100"), "--vocab must be at least 262"),
    (("generate", "hi", "--model", T, "--batch-invariant"), "--batch-invariant only applies to speculative decoding"),
    (("fetch-models", "--timeout", "0"), "--timeout must be above 0"),
    (("fetch-models", "--timeout", "nan"), "--timeout must be a finite number"),
    (("fetch-models", "--no-target", "--no-draft"), "nothing to fetch"),
    (("fetch-models", "--draft", "acme/other-draft", "--no-draft"), "--draft and --no-draft contradict"),
]


@pytest.mark.parametrize("args, message", USAGE_CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in USAGE_CASES])
def test_bad_usage_is_one_line_and_exit_2(run, pair, tmp_path, args, message):
    dirs = {"target": pair / "target", "draft": pair / "draft", "tmp": tmp_path}
    code, out, err = run(*(a.format(**dirs) for a in args))
    line = one_error_line(code, err, 2)
    assert message in line and out == ""
    assert not (tmp_path / "new").exists() and not (tmp_path / "bm3.json").exists()


@pytest.mark.parametrize("value, message", [("{bad", "not JSON"), ('{"no_such_knob": 1}', "no_such_knob")])
def test_a_malformed_planner_variable_is_refused_before_the_model_loads(run, pair, monkeypatch, value, message):
    from pdflash.offload.runtime import OffloadedModel

    monkeypatch.setenv("PDFLASH_PLANNER", value)
    monkeypatch.setattr(OffloadedModel, "load", lambda *a, **k: pytest.fail("loaded the model"))
    line = one_error_line(*run(*GEN[:3], pair / "target", "--draft", pair / "draft")[::2], 2)
    assert line.startswith("Error: PDFLASH_PLANNER") and message in line and "unset it" in line


# -- errors found while running: exit 1, one line ----------------------------------------------------
def test_prompt_longer_than_the_context_fails_before_any_forward(run, pair, monkeypatch):
    from pdflash.offload.runtime import OffloadedModel

    calls = []
    real = OffloadedModel.forward
    monkeypatch.setattr(OffloadedModel, "forward", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    long_prompt = "experts " * 6000  # well past the tiny preset's 4096 positions
    line = one_error_line(*run("generate", "-", "--model", pair / "target", "--json", stdin=long_prompt)[::2], 1)
    assert "the model's context holds 4096" in line and "shorten the prompt" in line
    line = one_error_line(*run(*GEN[:3], pair / "target", "--max-new-tokens", 4096)[::2], 1)
    assert "context holds 4096" in line and "lower --max-new-tokens to" in line
    assert calls == []  # refused before any forward


def test_non_utf8_prompt(run, pair, monkeypatch, capsys):
    line = one_error_line(*run("generate", "abc\udcff", "--model", pair / "target")[::2], 1)
    assert "not UTF-8" in line
    from pdflash.cli.main import main

    monkeypatch.setattr(sys, "argv", ["pdflash", "generate", "-", "--model", str(pair / "target")])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait\n"), encoding="utf-8"))
    with pytest.raises(SystemExit) as exc:
        main()
    line = one_error_line(exc.value.code, capsys.readouterr().err, 1)
    assert "on stdin is not UTF-8" in line and "0xe9" in line


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 0), ("num_local_experts", -2), ("hidden_size", "64")])
def test_damaged_config_field(run, pair, tmp_path, field, value):
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(pair / "target", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    line = one_error_line(*run("generate", PROMPT, "--model", d)[::2], 1)
    assert f"{field} must be a positive integer" in line


def test_a_hub_that_never_answers_is_given_up_after_the_timeout(run, tmp_path, monkeypatch):
    from huggingface_hub import constants

    with socket.socket() as silent:  # the kernel accepts connections into the backlog; nobody answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        code, _, err = run("fetch-models", "--no-draft", "--cache-dir", tmp_path / "cache", "--timeout", "0.5", "--json")
    line = one_error_line(code, err, 1)
    assert "did not answer within 0.5 s" in line and "--timeout" in line


def test_a_download_that_stalls_is_given_up_after_the_timeout(run, tmp_path, monkeypatch):
    import time

    from huggingface_hub import constants, file_download

    sys.path.insert(0, str(Path(__file__).parent))
    from hub_server import FakeRepo, HubServer

    class NoPause:  # huggingface_hub pauses 1 s between its 5 resume attempts; the test need not wait
        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, seconds):
            pass

    monkeypatch.setattr(file_download, "time", NoPause())

    weights = os.urandom(256 << 10)
    repo = FakeRepo("acme/stalls", {"config.json": b"{}", "model.safetensors": weights})
    with HubServer() as hub:
        hub.add(repo)
        stall = hub.stall(weights, after=0, every=True)  # headers, then silence, every time
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)  # HF_ENDPOINT, as read when huggingface_hub loaded
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        code, _, err = run("fetch-models", "--target", repo.repo_id, "--no-draft", "--cache-dir", tmp_path / "c",
                           "--timeout", "0.2", "--json")
        assert stall.reached.is_set()
        stall.release.set()
    line = one_error_line(code, err, 1)
    assert "stopped answering for 0.2 s while fetching acme/stalls/model.safetensors" in line


# -- make-synthetic never destroys what it did not write ---------------------------------------------
def _digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def precious(pair, tmp_path):
    """A directory holding a checkpoint someone else wrote (here: a copy of the fixture's)."""
    import shutil

    d = tmp_path / "downloaded"
    shutil.copytree(pair / "target", d)
    (d / "README.md").write_text("not ours\n")
    return d


def test_non_empty_directory_is_refused_without_force(run, precious):
    before = _digest(precious)
    line = one_error_line(*run("make-synthetic", precious, "--preset", "tiny")[::2], 1)
    assert "is not empty" in line and "--force" in line
    assert _digest(precious) == before


def test_space_is_checked_before_anything_is_touched(run, precious, monkeypatch):
    before = _digest(precious)
    real = os.statvfs

    class Small:  # a filesystem with 100 kB free
        f_frsize, f_bavail = 4096, 25

    monkeypatch.setattr(os, "statvfs", lambda p: Small() if str(p).startswith(str(precious.parent)) else real(p))
    line = one_error_line(*run("make-synthetic", precious, "--preset", "tiny", "--force")[::2], 1)
    assert re.search(r"needs 1\.\d\d MB but only 102 kB are free", line), line
    assert _digest(precious) == before  # weights, tokenizer and all intact


@pytest.mark.parametrize("where", ["new", "force"])
def test_a_full_disk_mid_write_leaves_nothing_behind(run, precious, tmp_path, monkeypatch, where):
    from pdflash.offload import synthetic

    before = _digest(precious)
    real, calls = synthetic._make_chunk, []

    def failing(*a, **k):  # the disk fills up on the third chunk
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(synthetic, "_make_chunk", failing)
    out = tmp_path / "a" / "b" if where == "new" else precious
    args = ("make-synthetic", out, "--preset", "tiny") + (("--force",) if where == "force" else ())
    line = one_error_line(*run(*args)[::2], 1)
    assert "no space left on the device" in line and "nothing was kept" in line
    assert not list(tmp_path.rglob("*.partial")) and not list(tmp_path.rglob(".pdflash-partial-*"))
    if where == "new":
        assert not (tmp_path / "a").exists()  # the directories it created are gone too
    assert _digest(precious) == before


def test_a_draft_writer_failure_is_one_line_and_leaves_nothing(run, tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    def failing(*a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    out = tmp_path / "pair"
    line = one_error_line(*run("make-synthetic", out, "--preset", "tiny", "--draft-preset", "tiny")[::2], 1)
    assert "cannot write the draft checkpoint" in line
    assert not out.exists()


@pytest.mark.parametrize("first", [True, False], ids=["at-once", "after-creating-parents"])
def test_read_only_filesystem(run, tmp_path, monkeypatch, first):
    real = Path.mkdir

    def read_only(self, *a, **k):
        if str(self).startswith(str(tmp_path)) and (first or self.name.startswith(".pdflash-partial-")):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", read_only)
    line = one_error_line(*run("make-synthetic", tmp_path / "ro" / "ck", "--preset", "tiny")[::2], 1)
    assert "Read-only file system" in line and "writable directory" in line
    assert not (tmp_path / "ro").exists()


def test_force_replaces_the_checkpoint_and_files_are_0644(run, precious):
    stale = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    for name in stale:  # weights of an older, sharded checkpoint: they would mix with the new one
        (precious / name).write_bytes(b"old")
    old_weights = _digest(precious)["model.safetensors"]
    old_mask = os.umask(0o022)
    try:
        code, out, err = run("make-synthetic", precious, "--preset", "tiny", "--force", "--draft-preset", "tiny",
                             "--seed", "9", "--json")
    finally:
        os.umask(old_mask)
    assert code == 0, err
    info = json.loads(out)
    assert (precious / "README.md").read_text() == "not ours\n"  # not a checkpoint file: kept
    assert not any((precious / name).exists() for name in stale)
    assert _digest(precious)["model.safetensors"] != old_weights
    assert "model.safetensors" in info["files"] and not list(precious.glob(".pdflash-partial-*"))
    modes = {p.relative_to(precious).as_posix(): p.stat().st_mode & 0o777 for p in precious.rglob("*") if p.is_file()}
    assert set(modes.values()) == {0o644}, modes
    assert "draft/model.safetensors" in modes


# -- Ctrl-C: SIGINT sent to a subprocess at a known point ----------------------------------------------
DRIVER = r"""
import os, sys, time
fd, hook, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]

def ready():  # tell the test where we are, then wait for its SIGINT
    os.write(fd, b"R")
    os.close(fd)
    for _ in range(3000):  # short sleeps, as busy work would: the interpreter checks for the signal
        time.sleep(0.1)    # between them even where another thread took it (one long sleep is not woken)

if hook == "decode":  # the fourth decode step: three decoded tokens after the first
    import importlib
    gen = importlib.import_module("pdflash.offload.generate")
    real, n = gen.decode_one_token, [0]
    def decode(*a, **k):
        n[0] += 1
        if n[0] == 4:
            ready()
        return real(*a, **k)
    gen.decode_one_token = decode
elif hook == "write":  # after the first chunk of the weights is on disk
    from pdflash.offload import synthetic
    class Progress:
        def __init__(self, *a):
            pass
        def __enter__(self):
            return lambda n: ready()
        def __exit__(self, *exc):
            return False
    synthetic._progress = Progress
elif hook == "bench":  # when the second repetition starts
    from pdflash.bench.runner import PriorityBench
    real, n = PriorityBench.run_one, [0]
    per_rep = int(os.environ["PER_REP"])
    def run_one(self, *a, **k):
        n[0] += 1
        if n[0] == per_rep + 1:
            ready()
        return real(self, *a, **k)
    PriorityBench.run_one = run_one

from pdflash.cli.main import main
sys.argv = ["pdflash", *args]
main()
"""


def interrupt(hook: str, *args, env=None) -> subprocess.CompletedProcess:
    r, w = os.pipe()
    # preexec_fn: SIGINT back to its default in the child (a test run started in the background of
    # a non-interactive shell ignores SIGINT, and Python then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(w), hook, *map(str, args)], pass_fds=(w,),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
    os.close(w)
    try:
        got = os.read(r, 1)  # blocks until the driver reached the point (or died: b"")
        if got == b"R":
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        os.close(r)
        if proc.poll() is None:
            proc.kill()
    assert got == b"R", err
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def interrupted_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines and lines[-1].startswith("Interrupted: "), proc.stderr
    return lines[-1]


@pytest.mark.parametrize("json_out", [True, False], ids=["json", "text"])
def test_ctrl_c_in_generate_prints_what_was_generated(pair, json_out):
    args = ("generate", PROMPT, "--model", pair / "target", "--max-new-tokens", 50, "--no-draft") + (
        ("--json",) if json_out else ())
    proc = interrupt("decode", *args)
    line = interrupted_line(proc)
    assert len([x for x in proc.stderr.splitlines() if x.strip()]) == 1  # one line on stderr
    assert "after 4 of 50 tokens" in line
    if json_out:
        report = json.loads(proc.stdout)  # one JSON object
        assert report["interrupted"] is True and report["stop_reason"] == "interrupted"
        assert len(report["token_ids"]) == report["generated_tokens"] == 4
    else:
        assert proc.stdout.strip()  # the text generated so far


def test_ctrl_c_in_make_synthetic_leaves_nothing(tmp_path):
    out = tmp_path / "new" / "ck"
    proc = interrupt("write", "make-synthetic", out, "--preset", "tiny")
    interrupted_line(proc)
    assert not (tmp_path / "new").exists()
    assert not list(tmp_path.rglob("*.partial"))


def test_ctrl_c_in_bench_priority_keeps_finished_repetitions(pair, tmp_path):
    out = tmp_path / "bm3.json"
    proc = interrupt("bench", "bench-priority", "--model", pair / "target", "--draft", pair / "draft", "--device",
                     "cpu", "--arms", "flat,banded", "--prompts", 1, "--repetitions", 3, "--warmup", 0,
                     "--max-new-tokens", 4, "--no-timeline", "--output", out, env={"PER_REP": "2"})
    line = interrupted_line(proc)
    assert "after 1 of 3 repetitions" in line and "partial" in line
    res = json.loads(out.read_text())
    assert res["partial"] == {"interrupted": True, "repetitions_finished": 1, "repetitions_asked": 3}
    assert {(s["arm"], s["repetition"]) for s in res["samples"]} == {("flat", 0), ("banded", 0)}
    assert "PARTIAL" in proc.stdout and "VERDICT" not in proc.stderr
