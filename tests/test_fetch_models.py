"""``pdflash fetch-models`` against a local stand-in for the Hugging Face Hub (tests/hub_server.py).

The CLI runs as a subprocess with HF_ENDPOINT / HF_HOME / HF_HUB_OFFLINE / HF_TOKEN in its
environment, so exit codes, stdout and stderr are checked end to end. The reference for every
downloaded file is the fake repository's own bytes.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hub_server import FakeRepo, HubServer  # noqa: E402

from pdflash import PdflashError  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

# Files that fetch-models must fetch from the target / draft below, and files it must leave alone.
TARGET_NEEDED = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
}
TARGET_UNWANTED = {
    "README.md",
    "pytorch_model.bin",
    "consolidated.safetensors",  # top level, but not named by the index
    "original/model.safetensors",
    "original/config.json",
    "metal/model.bin",
}
DRAFT_NEEDED = {"config.json", "model.safetensors"}


def make_target(repo_id: str = "acme/target", shard2_size: int = 3000, seed: int = 0, **kw) -> FakeRepo:
    rng = random.Random(seed)
    shard1, shard2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    index = {"metadata": {"total_size": 1}, "weight_map": {"a.weight": shard1, "b.weight": shard2, "c.bias": shard2}}
    files = {
        "config.json": b'{"model_type": "gpt_oss", "num_hidden_layers": 2}',
        "generation_config.json": b'{"eos_token_id": 1}',
        "model.safetensors.index.json": json.dumps(index).encode(),
        shard1: rng.randbytes(2000),
        shard2: rng.randbytes(shard2_size),
        "tokenizer.json": b'{"version": "1.0"}',
        "tokenizer_config.json": b'{"model_max_length": 8192}',
        "special_tokens_map.json": b'{"eos_token": "<|return|>"}',  # distinct: equal files share one blob
        "chat_template.jinja": b"{{ messages }}",
        **{name: rng.randbytes(300) for name in TARGET_UNWANTED},
    }
    return FakeRepo(repo_id, files, **kw)


def make_draft(repo_id: str = "acme/target-DFlash") -> FakeRepo:
    rng = random.Random(1)
    return FakeRepo(
        repo_id,
        {"config.json": b'{"architectures": ["DFlashDraftModel"]}', "model.safetensors": rng.randbytes(1500),
         "README.md": b"# draft", "dflash.py": b"# remote code"},
    )


@pytest.fixture
def hub():
    with HubServer() as server:
        yield server


def cli_env(home: Path, endpoint: str, **extra: str) -> dict[str, str]:
    hub_vars = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(hub_vars)}
    env.update(HF_HOME=str(home), HF_ENDPOINT=endpoint, HF_HUB_DISABLE_XET="1", PYTHONUNBUFFERED="1")
    env.pop("PDFLASH_DEBUG", None)
    env.update(extra)
    return env


def fetch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdflash.cli.main", "fetch-models", *args]


def run_cli(home: Path, endpoint: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        fetch_cmd(*args), env=cli_env(home, endpoint, **env), cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=120,
    )


def repo_args(target: FakeRepo | None, draft: FakeRepo | None) -> list[str]:
    args = ["--target", target.repo_id] if target else ["--no-target"]
    return args + (["--draft", draft.repo_id] if draft else ["--no-draft"])


def files_under(folder: Path) -> dict[str, bytes]:
    """Repository path -> content of every file under ``folder`` (symlinks followed), skipping .cache."""
    out = {}
    for p in folder.rglob("*"):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and not rel.startswith(".cache/"):
            out[rel] = p.read_bytes()
    return out


def assert_one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def served_paths(hub: HubServer) -> list[str]:
    """Paths the CLI asked for, without huggingface_hub's own best-effort telemetry calls."""
    return [r.path for r in hub.requests() if not r.path.startswith("/api/agent-harnesses")]


def test_fetch_only_needed_files_then_offline(hub: HubServer, tmp_path: Path):
    target, draft = hub.add(make_target()), hub.add(make_draft())
    home = tmp_path / "home"
    proc = run_cli(home, hub.url, *repo_args(target, draft), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)

    cache = home / "hub"
    target_dir = cache / "models--acme--target" / "snapshots" / target.commit
    draft_dir = cache / "models--acme--target-DFlash" / "snapshots" / draft.commit
    assert Path(out["target"]) == target_dir and Path(out["draft"]) == draft_dir
    assert files_under(target_dir) == {f: target.files[f] for f in TARGET_NEEDED}
    assert files_under(draft_dir) == {f: draft.files[f] for f in DRAFT_NEEDED}
    assert out["repos"]["target"]["commit"] == target.commit
    assert out["repos"]["target"]["downloaded_bytes"] == sum(len(target.files[f]) for f in TARGET_NEEDED)
    # Nothing unwanted was even asked for (neither HEAD nor GET).
    for name in TARGET_UNWANTED | {"README.md", "dflash.py"}:
        assert not [p for p in served_paths(hub) if p.endswith("/" + name)], name

    # Offline with a complete cache: same paths, no request at all, summary on stdout.
    hub.clear_log()
    proc = run_cli(home, hub.url, *repo_args(target, draft), HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, proc.stderr
    assert f"--model {target_dir}" in proc.stdout.splitlines()
    assert f"--draft {draft_dir}" in proc.stdout.splitlines()
    assert "HF_HUB_OFFLINE" in proc.stderr and "Traceback" not in proc.stderr
    assert hub.requests() == []

    # Online again with everything cached: nothing is downloaded a second time.
    hub.clear_log()
    proc = run_cli(home, hub.url, *repo_args(target, draft), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["repos"]["target"]["downloaded_bytes"] == 0
    assert not [p for p in served_paths(hub) if p.startswith("/lfs/")]


def test_local_dir(hub: HubServer, tmp_path: Path):
    target, draft = hub.add(make_target()), hub.add(make_draft())
    home, dest = tmp_path / "home", tmp_path / "models"
    proc = run_cli(home, hub.url, *repo_args(target, draft), "--local-dir", str(dest), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert Path(out["target"]) == dest / "target" and Path(out["draft"]) == dest / "target-DFlash"
    assert files_under(dest / "target") == {f: target.files[f] for f in TARGET_NEEDED}
    assert files_under(dest / "target-DFlash") == {f: draft.files[f] for f in DRAFT_NEEDED}
    assert not any(p.is_symlink() for p in dest.rglob("*"))
    assert not (home / "hub").exists() or not any((home / "hub").rglob("*.safetensors"))

    hub.clear_log()
    proc = run_cli(home, hub.url, *repo_args(target, draft), "--local-dir", str(dest), "--json", HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["target"] == str(dest / "target")
    assert hub.requests() == []
    # --model names the target repository as --target does (the ecosystem's spelling)
    args = [("--model" if a == "--target" else a) for a in repo_args(target, draft)]
    assert "--model" in args
    proc = run_cli(home, hub.url, *args, "--local-dir", str(dest), "--json", HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["target"] == str(dest / "target")


def test_dropped_connection_resumes_with_range(hub: HubServer, tmp_path: Path):
    # huggingface_hub writes in 10 MiB chunks: drop after 12 MiB so that the first chunk is on disk.
    target = hub.add(make_target(shard2_size=16 * MiB + 123))
    shard = target.files["model-00002-of-00002.safetensors"]
    hub.drop_once(shard, after=12 * MiB)
    proc = run_cli(tmp_path / "home", hub.url, *repo_args(target, None), "--json")
    assert proc.returncode == 0, proc.stderr
    path = Path(json.loads(proc.stdout)["target"]) / "model-00002-of-00002.safetensors"
    assert path.read_bytes() == shard

    gets = hub.requests("GET", hub.blob_path(shard))
    assert len(gets) == 2 and gets[0].range is None
    resumed_from = int(gets[1].range.removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_from <= 12 * MiB  # the second request continued, it did not start over


def test_interrupted_run_keeps_complete_files_and_rerun_finishes(hub: HubServer, tmp_path: Path):
    target = hub.add(make_target(shard2_size=4 * MiB))
    shard1, shard2 = (target.files[f"model-0000{i}-of-00002.safetensors"] for i in (1, 2))
    stall = hub.stall(shard2, after=1 * MiB)
    home = tmp_path / "home"
    env = cli_env(home, hub.url)
    # SIGINT back to its default in the child: a test run started in the background of a
    # non-interactive shell ignores SIGINT, and Python then installs no KeyboardInterrupt handler.
    proc = subprocess.Popen(fetch_cmd(*repo_args(target, None)), env=env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert stall.reached.wait(60), "the download never reached the stalled shard"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        stall.release.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode not in (0, None), stderr
    assert "Traceback" not in stderr
    snapshot = home / "hub" / "models--acme--target" / "snapshots" / target.commit
    assert (snapshot / "model-00001-of-00002.safetensors").read_bytes() == shard1
    assert not (snapshot / "model-00002-of-00002.safetensors").exists()  # nothing half-written in place

    # Offline, the incomplete copy is refused with a clear message rather than handed to --model.
    offline = run_cli(home, hub.url, *repo_args(target, None), HF_HUB_OFFLINE="1")
    assert_one_error_line(offline, "acme/target", "incomplete", "model-00002-of-00002.safetensors", "HF_HUB_OFFLINE")

    hub.clear_log()
    proc2 = run_cli(home, hub.url, *repo_args(target, None), "--json")
    assert proc2.returncode == 0, proc2.stderr
    assert (snapshot / "model-00002-of-00002.safetensors").read_bytes() == shard2
    assert hub.requests(contains=hub.blob_path(shard1)) == []  # the complete shard was kept
    assert json.loads(proc2.stdout)["repos"]["target"]["downloaded_bytes"] == len(shard2)


@pytest.mark.parametrize("token", [None, "hf_someone"], ids=["anonymous-401", "authenticated-404"])
def test_unknown_repo(hub: HubServer, tmp_path: Path, token: str | None):
    env = {"HF_TOKEN": token} if token else {}
    proc = run_cli(tmp_path / "home", hub.url, "--target", "acme/missing", "--no-draft", **env)
    assert_one_error_line(proc, "acme/missing", "not found", "HF_TOKEN")


def test_gated_repo(hub: HubServer, tmp_path: Path):
    target = hub.add(make_target("acme/gated", gated=True, tokens=("hf_granted",)))
    args = repo_args(target, None)
    line = assert_one_error_line(run_cli(tmp_path / "a", hub.url, *args), "acme/gated", "gated", "HF_TOKEN")
    assert f"{hub.url}/acme/gated" in line
    assert_one_error_line(run_cli(tmp_path / "b", hub.url, *args, HF_TOKEN="hf_other"), "acme/gated", "no access")
    assert not list((tmp_path / "b").rglob("*.safetensors"))

    proc = run_cli(tmp_path / "c", hub.url, *args, "--json", HF_TOKEN="hf_granted")
    assert proc.returncode == 0, proc.stderr
    assert files_under(Path(json.loads(proc.stdout)["target"])) == {f: target.files[f] for f in TARGET_NEEDED}


def test_unknown_revision(hub: HubServer, tmp_path: Path):
    target = hub.add(make_target())
    proc = run_cli(tmp_path / "home", hub.url, *repo_args(target, None), "--revision", "v9.9")
    assert_one_error_line(proc, "'v9.9'", "acme/target", "--revision")


def test_offline_without_cache(hub: HubServer, tmp_path: Path):
    target = hub.add(make_target())
    proc = run_cli(tmp_path / "home", hub.url, *repo_args(target, None), HF_HUB_OFFLINE="1")
    assert_one_error_line(proc, "acme/target", "HF_HUB_OFFLINE")
    assert hub.requests() == []


def test_hub_unreachable_without_cache(tmp_path: Path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    proc = run_cli(tmp_path / "home", closed, "--target", "acme/target", "--no-draft")
    assert_one_error_line(proc, "acme/target", "cannot reach", closed)


def test_nothing_to_fetch_is_a_usage_error(tmp_path: Path):
    proc = run_cli(tmp_path / "home", "http://127.0.0.1:9", "--no-target", "--draft", "")
    assert proc.returncode == 2 and proc.stderr.startswith("Error: nothing to fetch"), proc.stderr


# In-process: failures that cannot be staged over HTTP (a full disk), mapped by pdflash.hub.


def test_not_enough_disk_space_stops_before_the_shards(hub: HubServer, tmp_path: Path, monkeypatch):
    from pdflash import hub as hubmod

    target = hub.add(make_target())
    monkeypatch.setattr(hubmod, "_free_bytes", lambda path: 1000)
    with pytest.raises(PdflashError, match=r"not enough disk space for acme/target: .* --cache-dir"):
        hubmod.fetch_repo(target.repo_id, cache_dir=tmp_path / "cache", endpoint=hub.url, token=False)
    assert not [p for p in served_paths(hub) if p.startswith("/lfs/")]


def test_disk_full_during_download_is_one_clear_error(hub: HubServer, tmp_path: Path, monkeypatch):
    from pdflash import hub as hubmod

    target = hub.add(make_target())
    real = hubmod.hf_hub_download

    def disk_fills_on_shards(repo_id, filename, **kw):
        if filename.endswith(".safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(repo_id, filename, **kw)

    monkeypatch.setattr(hubmod, "hf_hub_download", disk_fills_on_shards)
    with pytest.raises(PdflashError) as info:
        hubmod.fetch_repo(target.repo_id, cache_dir=tmp_path / "cache", endpoint=hub.url, token=False)
    message = str(info.value)
    assert "no space left" in message and "acme/target/model-00001-of-00002.safetensors" in message
    assert "--cache-dir" in message and "\n" not in message


def test_models_set_names_the_qwen3_repositories(hub: HubServer, tmp_path: Path):
    """--models qwen3-coder-30b-a3b fetches Qwen's target and the published DFlash draft by name."""
    target = hub.add(make_target("Qwen/Qwen3-Coder-30B-A3B-Instruct"))
    draft = hub.add(make_draft("z-lab/Qwen3-Coder-30B-A3B-DFlash"))
    dest = tmp_path / "models"
    proc = run_cli(tmp_path / "home", hub.url, "--models", "qwen3-coder-30b-a3b", "--local-dir", str(dest), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["repos"]["target"]["repo_id"] == target.repo_id and out["repos"]["draft"]["repo_id"] == draft.repo_id
    assert files_under(dest / "Qwen3-Coder-30B-A3B-Instruct") == {f: target.files[f] for f in TARGET_NEEDED}
    proc = run_cli(tmp_path / "home", hub.url, "--models", "qwen3-30b-a3b", "--json", HF_HUB_OFFLINE="1")
    assert proc.returncode == 1 and "Qwen/Qwen3-30B-A3B" in proc.stderr  # no draft published: the target only
    proc = run_cli(tmp_path / "home", hub.url, "--models", "mixtral")
    assert proc.returncode == 2 and "qwen3-coder-30b-a3b" in proc.stderr
