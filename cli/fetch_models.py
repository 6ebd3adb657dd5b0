"""``pdflash fetch-models``: download the target and draft checkpoints from the Hugging Face Hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from pdflash import PdflashError

DEFAULT_TARGET = "openai/gpt-oss-20b"
DEFAULT_DRAFT = "z-lab/gpt-oss-20b-DFlash"
# --models NAME: the known target repositories and their published DFlash drafts ("" : none published).
MODEL_SETS = {
    "gpt-oss-20b": (DEFAULT_TARGET, DEFAULT_DRAFT),
    "gpt-oss-120b": ("openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash"),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", ""),
    "qwen3-30b-a3b-fp8": ("Qwen/Qwen3-30B-A3B-FP8", ""),
    "qwen3-coder-30b-a3b": ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash"),
}


def fetch_models(
    models: Annotated[
        str, typer.Option(help=f"Known target and draft pair: {', '.join(MODEL_SETS)}.")
    ] = "gpt-oss-20b",
    target: Annotated[
        Optional[str], typer.Option("--target", "--model", help="Target model repository on the Hub (owner/name), instead of the --models one; an empty string skips it. --model is the same option.")
    ] = None,
    draft: Annotated[
        Optional[str], typer.Option(help="DFlash draft repository on the Hub (owner/name), instead of the --models one; an empty string skips it.")
    ] = None,
    no_target: Annotated[bool, typer.Option("--no-target", help="Do not fetch the target model.")] = False,
    no_draft: Annotated[bool, typer.Option("--no-draft", help="Do not fetch the draft model.")] = False,
    revision: Annotated[
        str, typer.Option(help="Branch, tag or commit hash of the target repository.")
    ] = "main",
    draft_revision: Annotated[
        str, typer.Option(help="Branch, tag or commit hash of the draft repository.")
    ] = "main",
    local_dir: Annotated[
        Optional[Path],
        typer.Option(
            help="Put plain copies of the files in DIR/<repository name> instead of the Hugging Face cache.",
            metavar="DIR",
        ),
    ] = None,
    cache_dir: Annotated[
        Optional[Path],
        typer.Option(
            help="Hugging Face cache folder to use (default: HF_HUB_CACHE, else HF_HOME/hub).", metavar="DIR"
        ),
    ] = None,
    token: Annotated[
        Optional[str],
        typer.Option(help="Hub access token (default: HF_TOKEN, else the token saved by 'hf auth login')."),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of tables; no progress bars.")
    ] = False,
    timeout: Annotated[
        Optional[float],
        typer.Option(
            help="Seconds to wait for the Hub (to connect, to answer, for the next bytes of a file) before giving "
            "up; default: HF_HUB_DOWNLOAD_TIMEOUT, else 10.",
            metavar="SECONDS",
        ),
    ] = None,
) -> None:
    """Download only what pdflash loads: config, safetensors shards and index, tokenizer files.

    Prints the folders to pass to 'pdflash generate --model ... --draft ...'.

    Files go to the Hugging Face cache, or to plain folders under --local-dir.

    HF_TOKEN, HF_HOME, HF_HUB_CACHE, HF_ENDPOINT and HF_HUB_OFFLINE are honoured.

    Running the command again finishes an interrupted download; offline it only checks local copies.

    A Hub that stops answering is given up after --timeout seconds, with a message.

    Progress goes to stderr (off with --json or HF_HUB_DISABLE_PROGRESS_BARS=1).

    Examples:
      pdflash fetch-models
      pdflash fetch-models --no-draft --revision main --local-dir ./models
      pdflash fetch-models --models qwen3-coder-30b-a3b --local-dir ./models
      HF_HUB_OFFLINE=1 pdflash fetch-models --json
    """
    from huggingface_hub.utils import are_progress_bars_disabled
    from huggingface_hub.utils import logging as hf_logging

    from pdflash.cli import checks
    from pdflash.hub import fetch_repo

    checks.finite("--timeout", timeout, low=0, low_open=True)
    if models not in MODEL_SETS:
        raise checks.usage(f"unknown --models {models!r}: choose one of {', '.join(MODEL_SETS)}")
    # an explicit repository together with --no-X is a contradiction (None: the set's default)
    if no_target and target not in (None, ""):
        raise checks.usage("--target and --no-target contradict each other; give one")
    if no_draft and draft not in (None, ""):
        raise checks.usage("--draft and --no-draft contradict each other; give one")
    target = MODEL_SETS[models][0] if target is None else target
    draft = MODEL_SETS[models][1] if draft is None else draft
    jobs = []  # (role, repo id, revision)
    if target and not no_target:
        jobs.append(("target", target, revision))
    if draft and not no_draft:
        jobs.append(("draft", draft, draft_revision))
    if not jobs:
        raise PdflashError("nothing to fetch: both the target and the draft were skipped", exit_code=2)
    local_dirs = _local_dirs(local_dir, [repo for _, repo, _ in jobs])

    hf_logging.set_verbosity_error()  # huggingface_hub's own retry warnings; failures are reported below
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    results = {}
    with _listener(err, quiet=json_out or are_progress_bars_disabled()) as listener:
        for role, repo, rev in jobs:
            results[role] = fetch_repo(
                repo,
                revision=rev,
                cache_dir=cache_dir,
                local_dir=local_dirs.get(repo),
                token=token,
                listener=listener,
                timeout=timeout,
            )
    for result in results.values():
        if result.note:
            err.print(f"Warning: {result.note}")

    if json_out:
        out: dict = {role: (results[role].path if role in results else None) for role in ("target", "draft")}
        out["repos"] = {
            role: {
                "repo_id": r.repo_id,
                "revision": r.revision,
                "commit": r.commit,
                "path": r.path,
                "source": r.source,
                "files": r.files,
                "total_bytes": r.total_bytes,
                "downloaded_bytes": r.downloaded_bytes,
            }
            for role, r in results.items()
        }
        print(json.dumps(out, indent=2))
        return

    console = Console(highlight=False, soft_wrap=True)
    table = Table(title="pdflash fetch-models", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("role", "repository", "revision", "files", "size", "fetched"):
        table.add_column(col, justify="right" if col in ("files", "size", "fetched") else "left", no_wrap=True)
    for role, r in results.items():
        commit = f" ({r.commit[:8]})" if r.commit and r.commit != r.revision else ""
        table.add_row(
            role,
            r.repo_id,
            r.revision + commit,
            str(len(r.files)),
            _human(r.total_bytes),
            _human(r.downloaded_bytes) if r.source == "hub" else "local copy",
        )
    console.print(table)
    flags = {"target": "--model", "draft": "--draft"}
    for role, r in results.items():
        console.print(f"{flags[role]} {r.path}")


def _local_dirs(local_dir: Path | None, repos: list[str]) -> dict[str, Path]:
    """DIR/<name> per repository; DIR/<owner>--<name> if two repositories share a name."""
    if local_dir is None:
        return {}
    names = [repo.split("/")[-1] for repo in repos]
    clash = len(set(names)) < len(names)
    return {repo: local_dir / (repo.replace("/", "--") if clash else name) for repo, name in zip(repos, names)}


def _human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


class _NoProgress:
    """The listener protocol of pdflash.hub.FetchListener, ignoring everything; a context manager."""

    def __enter__(self) -> "_NoProgress":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def file_begin(self, repo_id: str, filename: str, size: int | None) -> None:
        pass

    def file_restart(self, repo_id: str, filename: str, total: int | None, initial: int) -> None:
        pass

    def file_bytes(self, repo_id: str, filename: str, n: int) -> None:
        pass

    def file_end(self, repo_id: str, filename: str, size: int, received: int) -> None:
        pass


def _listener(console: Console, quiet: bool) -> _NoProgress:
    """Progress on stderr: Rich bars on a terminal, one line per file otherwise, nothing when quiet."""
    if quiet:
        return _NoProgress()
    if console.is_terminal:
        return _RichProgress(console)
    return _PlainProgress(console)


class _RichProgress(_NoProgress):
    """One Rich progress bar per file, kept on screen when done."""

    def __init__(self, console: Console):
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self.tasks: dict[tuple[str, str], TaskID] = {}

    def __enter__(self) -> "_RichProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def file_begin(self, repo_id, filename, size):
        self.tasks[repo_id, filename] = self.progress.add_task(f"{repo_id} {filename}", total=size)

    def file_restart(self, repo_id, filename, total, initial):
        self.progress.update(self.tasks[repo_id, filename], total=total, completed=initial)

    def file_bytes(self, repo_id, filename, n):
        self.progress.advance(self.tasks[repo_id, filename], n)

    def file_end(self, repo_id, filename, size, received):
        state = "" if received else " [dim](already here)[/]"
        self.progress.update(
            self.tasks[repo_id, filename],
            total=size,
            completed=size,
            description=f"{repo_id} {filename}{state}",
        )


class _PlainProgress(_NoProgress):
    """One line per finished file, for logs and pipes."""

    def __init__(self, console: Console):
        self.console = console

    def file_end(self, repo_id, filename, size, received):
        how = f"downloaded {_human(received)}" if received else "already here"
        self.console.print(f"{repo_id} {filename}: {_human(size)}, {how}", markup=False)
