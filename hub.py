"""Fetch the files pdflash loads from a Hugging Face Hub model repository.

Only what loading needs is downloaded, all from the top level of the repository:

- ``config.json`` (required), ``generation_config.json``;
- ``model.safetensors.index.json`` and the shards its ``weight_map`` names, or every top-level
  ``*.safetensors`` when there is no index (subfolders such as ``original/`` are never fetched);
- tokenizer files: ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
  ``chat_template.jinja``.

Files go through ``huggingface_hub.hf_hub_download`` one at a time, so HF_TOKEN, HF_HOME,
HF_HUB_CACHE, HF_ENDPOINT and HF_HUB_OFFLINE behave as everywhere else in the ecosystem and the
cache layout is the usual one. Atomicity is huggingface_hub's: a file reaches its final path only
once complete. A connection dropped mid-file is resumed with an HTTP Range request inside the same
run; after an interrupted run, files already complete are kept and the next run fetches the rest.

When the Hub cannot be reached (offline mode, no network, server error), a complete local copy
(cache snapshot or ``local_dir``) is used instead. Every expected failure becomes a
:class:`pdflash.PdflashError` whose message names the repository and says what to do.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from pdflash import PdflashError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
# Small files fetched when the repository has them, in this order; config.json is required.
METADATA_FILES = (
    CONFIG_FILE,
    "generation_config.json",
    INDEX_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
WEIGHTS_SUFFIX = ".safetensors"


def _request_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's "request failed" base classes (httpx2 for huggingface_hub 2.x, httpx for 1.x)."""
    found = []
    for name in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(name).RequestError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


_REQUEST_ERRORS = _request_errors()


def _timeout_errors() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = [TimeoutError]
    for name in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(name).TimeoutException)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


_TIMEOUT_ERRORS = _timeout_errors()


def _is_timeout(exc: BaseException | None) -> bool:
    """Whether ``exc`` or an exception it was raised from is a network timeout."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, _TIMEOUT_ERRORS):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def default_timeout() -> float:
    """Seconds to wait for the Hub when no timeout is given: HF_HUB_DOWNLOAD_TIMEOUT, else 10."""
    return float(hf_constants.HF_HUB_DOWNLOAD_TIMEOUT)


@contextlib.contextmanager
def _hub_timeouts(seconds: float):
    """huggingface_hub reads its download and metadata timeouts from module constants at call time."""
    saved = hf_constants.HF_HUB_DOWNLOAD_TIMEOUT, hf_constants.HF_HUB_ETAG_TIMEOUT
    hf_constants.HF_HUB_DOWNLOAD_TIMEOUT = hf_constants.HF_HUB_ETAG_TIMEOUT = seconds
    try:
        yield
    finally:
        hf_constants.HF_HUB_DOWNLOAD_TIMEOUT, hf_constants.HF_HUB_ETAG_TIMEOUT = saved


class FetchListener:
    """Receives download progress; the default ignores it. Calls come from the calling thread."""

    def file_begin(self, repo_id: str, filename: str, size: int | None) -> None:
        """A file is about to be checked against the cache and downloaded if needed."""

    def file_restart(self, repo_id: str, filename: str, total: int | None, initial: int) -> None:
        """Bytes are about to arrive; ``initial`` bytes were already on disk (resumed)."""

    def file_bytes(self, repo_id: str, filename: str, n: int) -> None:
        """``n`` bytes were written (negative when a server ignored a Range and the file restarts)."""

    def file_end(self, repo_id: str, filename: str, size: int, received: int) -> None:
        """The file is complete at its final path; ``received`` bytes came over the network."""


@dataclass
class FetchResult:
    """Where one repository's files are, and how they got there."""

    repo_id: str
    revision: str  # as asked for: branch, tag or commit
    commit: str | None  # resolved commit; None for a local_dir copy used offline
    path: str  # folder to pass to --model / --draft
    files: list[str]  # repository paths present under `path`
    total_bytes: int  # size of `files`
    downloaded_bytes: int = 0  # received over the network by this call
    source: str = "hub"  # "hub": checked against the Hub; "local": local copy used without the Hub
    note: str | None = None  # why the local copy was used, when it was


def fetch_repo(
    repo_id: str,
    *,
    revision: str = "main",
    cache_dir: str | os.PathLike | None = None,
    local_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    listener: FetchListener | None = None,
    timeout: float | None = None,
) -> FetchResult:
    """Download (or find) the loadable files of ``repo_id`` at ``revision``.

    Without ``local_dir`` the files land in the Hugging Face cache (``cache_dir`` or the default
    from HF_HUB_CACHE / HF_HOME) and the returned path is the snapshot folder of the resolved
    commit. With ``local_dir`` they are plain files in that folder. ``endpoint`` defaults to
    HF_ENDPOINT. ``timeout`` (default :func:`default_timeout`) bounds every wait for the Hub: to
    connect, for an answer, for the next bytes of a file. Raises PdflashError for every expected
    failure.
    """
    seconds = default_timeout() if timeout is None else float(timeout)
    with _hub_timeouts(seconds):
        return _fetch_repo(repo_id, revision, cache_dir, local_dir, token, endpoint, listener or FetchListener(), seconds)


def _fetch_repo(repo_id, revision, cache_dir, local_dir, token, endpoint, listener, timeout: float) -> FetchResult:
    api = HfApi(endpoint=endpoint, token=token)
    ctx = _Context(repo_id, revision, api.endpoint, cache_dir, local_dir, timeout)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True, timeout=timeout)
    except Exception as exc:
        if _hub_unreachable(exc):
            return _from_local_copy(ctx, exc)
        _raise_explained(exc, ctx)

    # repository path -> size in bytes (None if the Hub did not say)
    sizes: dict[str, int | None] = {
        s.rfilename: (s.lfs.size if s.lfs is not None else s.size) for s in (info.siblings or [])
    }
    commit = info.sha
    if CONFIG_FILE not in sizes:
        raise PdflashError(
            f"{repo_id} (revision {revision}) has no top-level {CONFIG_FILE}, so it is not a model "
            "repository pdflash can load: check the repo id"
        )
    _check_writable(ctx)
    download = _Downloader(ctx, commit, sizes, token, endpoint, listener)

    # config.json goes first and by revision name, so that the cache records refs/<revision> -> commit
    # (what offline runs and transformers resolve); everything else is pinned to that commit.
    config_path = download(CONFIG_FILE, by_name=True)
    if local_dir is None and Path(config_path).parent.name != commit:
        raise PdflashError(
            f"{repo_id} revision {revision} moved to a new commit while fetching it: run the same command again"
        )
    for name in METADATA_FILES[1:]:
        if name in sizes:
            download(name)

    shards = _select_shards(ctx, sizes, download.paths.get(INDEX_FILE))
    missing_bytes = sum(sizes[s] or 0 for s in shards if not _present(ctx, commit, s, sizes[s]))
    free = _free_bytes(ctx.destination)
    if free is not None and missing_bytes > free:
        raise PdflashError(
            f"not enough disk space for {repo_id}: {_gb(missing_bytes)} still to download but only "
            f"{_gb(free)} free in {ctx.destination}; free some space or pass --cache-dir / --local-dir "
            "on a larger disk"
        )
    for shard in shards:
        download(shard)

    base = str(Path(local_dir).resolve()) if local_dir is not None else str(Path(config_path).parent)
    return FetchResult(
        repo_id=repo_id,
        revision=revision,
        commit=commit,
        path=base,
        files=list(download.paths),
        total_bytes=sum(os.path.getsize(p) for p in download.paths.values()),
        downloaded_bytes=download.received,
    )


@dataclass
class _Context:
    """What every message needs: which repo, where from, where to."""

    repo_id: str
    revision: str
    hub: str  # endpoint URL
    cache_dir: str | os.PathLike | None
    local_dir: str | os.PathLike | None
    timeout: float = 10.0  # seconds, for messages

    @property
    def destination(self) -> Path:
        if self.local_dir is not None:
            return Path(self.local_dir)
        return Path(self.cache_dir if self.cache_dir is not None else hf_constants.HF_HUB_CACHE)

    @property
    def where(self) -> str:
        if self.local_dir is not None:
            return f"--local-dir {self.local_dir}"
        return f"the cache {self.destination}"


class _Downloader:
    """Calls hf_hub_download for one file at a time; remembers paths and counts received bytes."""

    def __init__(self, ctx: _Context, commit: str, sizes: dict[str, int | None], token, endpoint, listener):
        self.ctx, self.commit, self.sizes = ctx, commit, sizes
        self.token, self.endpoint, self.listener = token, endpoint, listener
        self.paths: dict[str, str] = {}  # repository path -> local path, in download order
        self.received = 0

    def __call__(self, filename: str, by_name: bool = False) -> str:
        ctx = self.ctx
        counted = [0]  # bytes received for this file, over all restarts
        self.listener.file_begin(ctx.repo_id, filename, self.sizes.get(filename))
        try:
            path = hf_hub_download(
                ctx.repo_id,
                filename,
                revision=ctx.revision if by_name else self.commit,
                cache_dir=ctx.cache_dir,
                local_dir=ctx.local_dir,
                token=self.token,
                endpoint=self.endpoint,
                etag_timeout=ctx.timeout,
                tqdm_class=_bar_class(self.listener, ctx.repo_id, filename, counted),
            )
        except Exception as exc:
            _raise_explained(exc, ctx, filename)
        self.paths[filename] = path
        self.received += max(counted[0], 0)
        self.listener.file_end(ctx.repo_id, filename, os.path.getsize(path), max(counted[0], 0))
        return path


def _bar_class(listener: FetchListener, repo_id: str, filename: str, counted: list[int]) -> type:
    """A tqdm stand-in for hf_hub_download (which instantiates the class itself): it forwards
    progress to ``listener`` and adds received bytes to ``counted[0]``."""

    class _Bar:
        def __init__(self, *args, total: int | None = None, initial: int = 0, **kwargs):
            listener.file_restart(repo_id, filename, total, initial)

        def update(self, n: int | float | None = 1) -> None:
            n = int(n or 0)
            counted[0] += n
            listener.file_bytes(repo_id, filename, n)

        def close(self) -> None:
            pass

        def refresh(self, *args, **kwargs) -> None:
            pass

        def set_description(self, *args, **kwargs) -> None:
            pass

        def set_postfix_str(self, *args, **kwargs) -> None:
            pass

        def __enter__(self) -> "_Bar":
            return self

        def __exit__(self, *exc) -> None:
            self.close()

    return _Bar


def _select_shards(ctx: _Context, sizes: dict[str, int | None], index_path: str | None) -> list[str]:
    """Shards named by the index (all must exist in the repo), else every top-level *.safetensors."""
    if index_path is None:
        shards = sorted(f for f in sizes if "/" not in f and f.endswith(WEIGHTS_SUFFIX))
        if not shards:
            raise PdflashError(
                f"{ctx.repo_id} (revision {ctx.revision}) has no top-level *{WEIGHTS_SUFFIX} weights and no "
                f"{INDEX_FILE}: pdflash loads safetensors checkpoints only"
            )
        return shards
    shards = _index_shards(Path(index_path), ctx.repo_id)
    absent = [s for s in shards if s not in sizes]
    if absent:
        raise PdflashError(
            f"{ctx.repo_id} (revision {ctx.revision}): {INDEX_FILE} names {', '.join(absent[:3])} which the "
            "repository does not contain; the repository is inconsistent, pick another --revision"
        )
    return shards


def _index_shards(index_path: Path, repo_id: str) -> list[str]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PdflashError(f"{repo_id}: {index_path} is not a valid safetensors index ({exc})") from exc


def _present(ctx: _Context, commit: str, filename: str, size: int | None) -> bool:
    """Whether ``filename`` at ``commit`` is already complete at the destination (no download needed)."""
    if ctx.local_dir is not None:
        path = Path(ctx.local_dir) / filename
        return path.is_file() and (size is None or path.stat().st_size == size)
    cached = try_to_load_from_cache(ctx.repo_id, filename, cache_dir=ctx.cache_dir, revision=commit)
    return isinstance(cached, str)


def _check_writable(ctx: _Context) -> None:
    """Create the destination folder, so that a bad --cache-dir / --local-dir fails before any download."""
    try:
        ctx.destination.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PdflashError(
            f"cannot create {ctx.destination} for {ctx.repo_id} ({exc.strerror}): pass a writable --cache-dir "
            "or --local-dir"
        ) from exc


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    for candidate in (path, *path.resolve().parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def _from_local_copy(ctx: _Context, cause: Exception) -> FetchResult:
    """The Hub is out of reach: use a complete local copy, or explain why there is none."""
    offline = isinstance(cause, OfflineModeIsEnabled)
    if ctx.local_dir is not None:
        base: Path | None = Path(ctx.local_dir).resolve()
        if not (base / CONFIG_FILE).is_file():
            base = None
    else:
        cached = try_to_load_from_cache(ctx.repo_id, CONFIG_FILE, cache_dir=ctx.cache_dir, revision=ctx.revision)
        base = Path(cached).parent if isinstance(cached, str) else None
    if base is None and offline:
        raise PdflashError(
            f"{ctx.repo_id} (revision {ctx.revision}) is not in {ctx.where} and HF_HUB_OFFLINE=1 forbids "
            "downloading it: unset HF_HUB_OFFLINE and run fetch-models once with network access"
        ) from cause
    if base is None and _is_timeout(cause):
        raise PdflashError(
            f"the Hub at {ctx.hub} did not answer within {ctx.timeout:g} s and {ctx.repo_id} (revision "
            f"{ctx.revision}) is not in {ctx.where}: check the network, proxy or HF_ENDPOINT, or allow more "
            "time with --timeout SECONDS"
        ) from cause
    if base is None:
        raise PdflashError(
            f"cannot reach the Hub at {ctx.hub} ({_short(cause)}) and {ctx.repo_id} (revision {ctx.revision}) "
            f"is not in {ctx.where}: check the network connection, proxy or HF_ENDPOINT, then run again"
        ) from cause

    files = [name for name in METADATA_FILES if (base / name).is_file()]
    index = base / INDEX_FILE
    shards = (
        _index_shards(index, ctx.repo_id)
        if index.is_file()
        else sorted(p.name for p in base.glob(f"*{WEIGHTS_SUFFIX}") if p.is_file())
    )
    missing = [s for s in shards if not (base / s).is_file()] or ([] if shards else [f"*{WEIGHTS_SUFFIX}"])
    if missing:
        how = "unset HF_HUB_OFFLINE and " if offline else "restore the connection and "
        raise PdflashError(
            f"the copy of {ctx.repo_id} in {base} is incomplete ({len(missing)} weight file(s) missing, e.g. "
            f"{missing[0]}) and the Hub cannot be used ({_short(cause)}): {how}run fetch-models again to finish it"
        ) from cause
    files += [s for s in shards if s not in files]
    why = "HF_HUB_OFFLINE=1" if offline else f"the Hub is unreachable: {_short(cause)}"
    return FetchResult(
        repo_id=ctx.repo_id,
        revision=ctx.revision,
        commit=base.name if ctx.local_dir is None else None,
        path=str(base),
        files=files,
        total_bytes=sum((base / f).stat().st_size for f in files),
        source="local",
        note=f"{ctx.repo_id}: using the local copy without checking the Hub for updates ({why})",
    )


def _hub_unreachable(exc: BaseException) -> bool:
    """Offline mode, no connection, or a Hub-side failure: a local copy may stand in."""
    if isinstance(exc, OfflineModeIsEnabled) or (_REQUEST_ERRORS and isinstance(exc, _REQUEST_ERRORS)):
        return True
    if isinstance(exc, HfHubHTTPError) and not isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError)):
        status = _status(exc)
        return status is not None and status >= 500
    return False


def _raise_explained(exc: BaseException, ctx: _Context, filename: str | None = None):
    """Raise the PdflashError that explains ``exc``, or ``exc`` itself when it is not expected."""
    explained = _explain(exc, ctx, filename)
    if explained is exc:
        raise exc
    raise explained from exc


def _explain(exc: BaseException, ctx: _Context, filename: str | None = None) -> BaseException:
    """Turn a huggingface_hub / HTTP / filesystem failure into a one-line PdflashError.

    Returns ``exc`` itself when it is not an expected failure (a bug: let it show its traceback).
    """
    repo, rev, hub = ctx.repo_id, ctx.revision, ctx.hub
    what = f"{repo}/{filename}" if filename else repo
    if isinstance(exc, PdflashError):
        return exc
    if isinstance(exc, GatedRepoError):
        if _status(exc) == 403:
            return PdflashError(
                f"{repo} is a gated repository and the token in use has no access to it: accept its conditions "
                f"at {hub}/{repo} with the account of that token (or use another token via HF_TOKEN)"
            )
        return PdflashError(
            f"{repo} is a gated repository and no token was accepted: accept its conditions at {hub}/{repo}, "
            "then set HF_TOKEN to a token of that account (or run 'hf auth login')"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return PdflashError(
            f"repository {repo} was not found on {hub} (or it is private and the token in use cannot see it): "
            "check the repo id, or set HF_TOKEN to a token with access"
        )
    if isinstance(exc, RevisionNotFoundError):
        return PdflashError(
            f"revision {rev!r} does not exist in {repo}: pass an existing branch, tag or commit hash with "
            "--revision / --draft-revision"
        )
    if isinstance(exc, RemoteEntryNotFoundError):
        return PdflashError(
            f"{what} is listed at revision {rev} but the Hub does not serve it: run again later or pick "
            "another revision"
        )
    if isinstance(exc, HFValidationError):
        return PdflashError(f"{repo!r} is not a valid Hub repository id: use owner/name, e.g. openai/gpt-oss-20b")
    if isinstance(exc, (OfflineModeIsEnabled, LocalEntryNotFoundError)) or (
        _REQUEST_ERRORS and isinstance(exc, _REQUEST_ERRORS)
    ):
        cause = exc.__cause__ or exc
        if _is_timeout(exc):
            return PdflashError(
                f"the Hub at {hub} stopped answering for {ctx.timeout:g} s while fetching {what}: check the "
                "network and run the same command again (files already complete are kept), or allow more time "
                "with --timeout SECONDS"
            )
        if isinstance(cause, OfflineModeIsEnabled) or isinstance(exc, OfflineModeIsEnabled):
            return PdflashError(
                f"{what} is not in {ctx.where} and HF_HUB_OFFLINE=1 forbids downloading it: unset "
                "HF_HUB_OFFLINE and run fetch-models with network access"
            )
        return PdflashError(
            f"lost the connection to {hub} while fetching {what} ({_short(cause)}): check the network and run "
            "the same command again; files already complete are kept"
        )
    if isinstance(exc, HfHubHTTPError) and _status(exc) == 401:
        return PdflashError(
            f"the Hub at {hub} rejected the access token while fetching {what} (HTTP 401): check HF_TOKEN "
            "or 'hf auth login', or unset HF_TOKEN for public repositories"
        )
    if isinstance(exc, HfHubHTTPError):
        return PdflashError(
            f"the Hub at {hub} refused {what} with HTTP {_status(exc)} ({_short(exc)}): run again later"
        )
    if isinstance(exc, OSError):
        if exc.errno == errno.ENOSPC:
            return PdflashError(
                f"no space left on the device while downloading {what} into {ctx.destination}: free some "
                "space or pass --cache-dir / --local-dir on a larger disk, then run again (complete files are kept)"
            )
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR):
            return PdflashError(
                f"cannot write {what} into {ctx.destination} ({exc.strerror}): pass a writable --cache-dir or "
                "--local-dir"
            )
        return PdflashError(f"downloading {what} failed ({_short(exc)}): run the same command again")
    return exc


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _short(exc: BaseException) -> str:
    """The first line of an exception's message, prefixed by its class name."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"
