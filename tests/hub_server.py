"""A local stand-in for the part of the Hugging Face Hub HTTP API that ``huggingface_hub`` uses
to fetch a model: ``HfApi.model_info`` and ``hf_hub_download``.

Routes (what huggingface_hub 1.x and 2.x request, read from their file_download.py / hf_api.py):

- ``GET /api/models/{owner}/{name}[/revision/{rev}]`` -> model info JSON: ``id``, ``sha`` (the
  resolved commit) and ``siblings`` (``rfilename``, ``size``, ``blobId``, ``lfs`` for LFS files).
- ``HEAD|GET /{owner}/{name}/resolve/{rev}/{path}`` -> for regular files 200 with ``ETag`` (git blob
  sha1), ``X-Repo-Commit``, ``Content-Length``; for LFS files (``*.safetensors``, ``*.bin``) 302 with
  ``Location`` on another origin (``localhost`` instead of ``127.0.0.1``, like the Hub's CDN),
  ``X-Linked-Etag`` (sha256) and ``X-Linked-Size``.
- ``GET /lfs/{sha256}`` -> the LFS blob, honouring ``Range: bytes=a-[b]`` with 206.

Errors carry the Hub's ``X-Error-Code`` header so that huggingface_hub raises its typed errors:
unknown repository -> 401 ``RepoNotFound`` without a token, 404 with one; unknown revision -> 404
``RevisionNotFound``; unknown file -> 404 ``EntryNotFound``; gated repository -> model info is
public, files answer 401 ``GatedRepo`` without a token and 403 with a token that has no access.

Faults for tests: ``drop_once`` sends part of a blob then closes the connection (once);
``stall`` sends part of a blob then holds the connection until released. Every request is logged.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    """A model repository at a single commit, reachable as branch ``main`` or by its commit hash."""

    repo_id: str
    files: dict[str, bytes]
    gated: bool = False
    tokens: tuple[str, ...] = ()  # tokens with access to a gated repository
    commit: str = field(init=False)

    def __post_init__(self) -> None:
        h = hashlib.sha1()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        self.commit = h.hexdigest()

    def resolve(self, rev: str) -> str | None:
        return self.commit if rev in ("main", self.commit) else None

    @staticmethod
    def is_lfs(name: str) -> bool:
        return name.endswith(LFS_SUFFIXES)


@dataclass
class Logged:
    method: str
    path: str  # as requested, still quoted
    range: str | None
    auth: bool


@dataclass
class _Fault:
    after: int  # bytes sent before the fault
    kind: str  # "drop" or "stall"
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    used: bool = False
    repeat: bool = False  # fault every GET, not only the first


class HubServer:
    """Serve ``FakeRepo`` objects on 127.0.0.1 (ephemeral port) from a background thread."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.log: list[Logged] = []
        self._faults: dict[str, _Fault] = {}  # sha256 of an LFS blob -> fault
        self._blobs: dict[str, bytes] = {}  # sha256 -> content
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cdn_url = f"http://localhost:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-hub", daemon=True)

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for fault in self._faults.values():
            fault.release.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def add(self, repo: FakeRepo) -> FakeRepo:
        self.repos[repo.repo_id] = repo
        for name, data in repo.files.items():
            if repo.is_lfs(name):
                self._blobs[hashlib.sha256(data).hexdigest()] = data
        return repo

    def drop_once(self, data: bytes, after: int) -> None:
        """The first GET of blob ``data`` sends ``after`` bytes, then the connection is closed."""
        self._faults[hashlib.sha256(data).hexdigest()] = _Fault(after, "drop")

    def stall(self, data: bytes, after: int, every: bool = False) -> _Fault:
        """The first GET of blob ``data`` (``every``: each GET) sends ``after`` bytes, sets ``reached``,
        waits for ``release``."""
        fault = self._faults[hashlib.sha256(data).hexdigest()] = _Fault(after, "stall", repeat=every)
        return fault

    def requests(self, method: str | None = None, contains: str = "") -> list[Logged]:
        with self._lock:
            return [r for r in self.log if (method is None or r.method == method) and contains in r.path]

    def clear_log(self) -> None:
        with self._lock:
            self.log.clear()

    def blob_path(self, data: bytes) -> str:
        return f"/lfs/{hashlib.sha256(data).hexdigest()}"


_RESOLVE = re.compile(r"^/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$")
_INFO = re.compile(r"^/api/models/([^/]+)/([^/]+)(?:/revision/([^/]+))?$")
_BLOB = re.compile(r"^/lfs/([0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _make_handler(server: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        # -- plumbing -------------------------------------------------------------------------
        def _send(self, status: int, headers: dict[str, str], body: bytes = b"", head: bool = False) -> None:
            self.send_response(status)
            headers = {"Content-Length": str(len(body)), **headers}
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if not head and body:
                self.wfile.write(body)

        def _error(self, status: int, code: str | None, message: str, head: bool, extra=None) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, headers, json.dumps({"error": message}).encode(), head)

        def _token(self) -> str | None:
            auth = self.headers.get("Authorization", "")
            return auth[len("Bearer ") :] if auth.startswith("Bearer ") else None

        def _route(self, head: bool) -> None:
            raw = urlsplit(self.path).path
            with server._lock:
                server.log.append(
                    Logged(self.command, raw, self.headers.get("Range"), self.headers.get("Authorization") is not None)
                )
            if m := _INFO.match(raw):
                return self._info(unquote(m[1]) + "/" + unquote(m[2]), unquote(m[3] or "main"), head)
            if m := _RESOLVE.match(raw):
                return self._resolve(unquote(m[1]) + "/" + unquote(m[2]), unquote(m[3]), unquote(m[4]), head)
            if m := _BLOB.match(raw):
                return self._blob(m[1], head)
            self._error(404, None, "Not Found", head)

        def _repo(self, repo_id: str, head: bool) -> FakeRepo | None:
            repo = server.repos.get(repo_id)
            if repo is None:  # the Hub answers 401 to anonymous callers, 404 to authenticated ones
                self._error(404 if self._token() else 401, "RepoNotFound", "Repository not found", head)
            return repo

        # -- routes ---------------------------------------------------------------------------
        def _info(self, repo_id: str, rev: str, head: bool) -> None:
            repo = self._repo(repo_id, head)
            if repo is None:
                return
            commit = repo.resolve(rev)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            siblings = []
            for name, data in sorted(repo.files.items()):
                entry = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}
                if repo.is_lfs(name):
                    entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
                siblings.append(entry)
            body = {
                "_id": repo.commit[:24],
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "sha": commit,
                "private": False,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "tags": [],
                "siblings": siblings,
            }
            self._send(200, {"Content-Type": "application/json"}, json.dumps(body).encode(), head)

        def _resolve(self, repo_id: str, rev: str, filename: str, head: bool) -> None:
            repo = self._repo(repo_id, head)
            if repo is None:
                return
            if repo.gated and self._token() not in repo.tokens:
                status = 403 if self._token() else 401
                return self._error(status, "GatedRepo", f"Access to model {repo_id} is restricted.", head)
            commit = repo.resolve(rev)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            data = repo.files.get(filename)
            if data is None:
                return self._error(404, "EntryNotFound", "Entry not found", head, {"X-Repo-Commit": commit})
            if repo.is_lfs(filename):
                sha256 = hashlib.sha256(data).hexdigest()
                headers = {
                    "Location": f"{server.cdn_url}/lfs/{sha256}",
                    "X-Repo-Commit": commit,
                    "X-Linked-Etag": f'"{sha256}"',
                    "X-Linked-Size": str(len(data)),
                    "ETag": f'"{git_blob_sha1(data)}"',
                }
                return self._send(302, headers, b"", head)
            headers = {
                "ETag": f'"{git_blob_sha1(data)}"',
                "X-Repo-Commit": commit,
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
            self._send_range(data, headers, head)

        def _blob(self, sha256: str, head: bool) -> None:
            data = server._blobs.get(sha256)
            if data is None:
                return self._error(404, None, "Not Found", head)
            fault = server._faults.get(sha256)
            if not head and fault is not None and not fault.used:
                fault.used = not fault.repeat
                return self._send_range(data, {"Accept-Ranges": "bytes"}, head, fault)
            self._send_range(data, {"Accept-Ranges": "bytes", "ETag": f'"{sha256}"'}, head)

        def _send_range(self, data: bytes, headers: dict[str, str], head: bool, fault: _Fault | None = None) -> None:
            start, end, status = 0, len(data) - 1, 200
            if (m := _RANGE.match(self.headers.get("Range", ""))) is not None:
                start, end, status = int(m[1]), int(m[2]) if m[2] else len(data) - 1, 206
                if start >= len(data):
                    return self._error(416, None, "Range Not Satisfiable", head)
                end = min(end, len(data) - 1)
                headers = {**headers, "Content-Range": f"bytes {start}-{end}/{len(data)}"}
            body = data[start : end + 1]
            if fault is None:
                return self._send(status, headers, body, head)
            # Announce the whole body, send only part of it, then fail.
            self.send_response(status)
            for k, v in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body[: fault.after])
            self.wfile.flush()
            fault.reached.set()
            if fault.kind == "stall":
                fault.release.wait(timeout=60)
            self.close_connection = True

    return Handler
