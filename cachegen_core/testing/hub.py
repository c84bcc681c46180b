"""A stand-in for the Hugging Face hub on 127.0.0.1, serving repositories a test writes, so that loading a model by
hub id is tested with the real huggingface_hub client and no network.

It answers what huggingface_hub's downloads (``snapshot_download``, ``hf_hub_download``, ``list_repo_files``) call:

- ``GET /api/models/{repo}[/revision/{rev}]``: the repository's info (``sha``, the commit; ``siblings``);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: its files (one page; ``recursive``);
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: a file, with ``ETag``, ``X-Repo-Commit``, ``Content-Length`` (and
  byte ranges, for resumed downloads);

and fails as the hub does: ``X-Error-Code`` ``RepoNotFound`` (401), ``RevisionNotFound`` or ``EntryNotFound`` (404,
the latter with the commit). Each request is recorded (:attr:`StandInHub.requests`), so a test sees what was
fetched. huggingface_hub reads ``HF_ENDPOINT``, ``HF_HOME`` and ``HF_HUB_OFFLINE`` once, at import:
:meth:`StandInHub.environment` sets them and the module constants they became, for this process;
:meth:`StandInHub.env` gives them to a child process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass(frozen=True)
class _Revision:
    commit: str
    files: dict[str, bytes]


class StandInHub:
    """A hub on 127.0.0.1 (``with StandInHub() as hub:``); :meth:`add` a repository, point the client at :attr:`url`."""

    def __init__(self) -> None:
        self._repos: dict[str, dict[str, _Revision]] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.requests: list[tuple[str, str]] = []
        """``(method, path)`` of every request, in order."""

    def add(self, repo_id: str, files: str | Path | Mapping[str, bytes], *, revision: str = "main") -> str:
        """Serve ``files`` (a directory's files, or names to bytes) as ``repo_id`` at ``revision``; returns its commit."""
        if isinstance(files, (str, Path)):
            root = Path(files)
            files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        h = hashlib.sha1(repo_id.encode())
        for name in sorted(files):
            h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        rev = _Revision(h.hexdigest(), dict(files))
        with self._lock:
            self._repos.setdefault(repo_id, {})[revision] = rev
        return rev.commit

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the stand-in hub is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def downloads(self) -> list[str]:
        """The files sent (``GET`` of ``/{repo}/resolve/{rev}/{file}``), as ``repo/file``."""
        return [_file_of(path) for method, path in self.requests if method == "GET" and "/resolve/" in path]

    def start(self) -> StandInHub:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), name="stand-in-hub", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> StandInHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self, home: str | Path, *, offline: bool = False) -> dict[str, str]:
        """The environment of a process using this hub, its Hugging Face cache under ``home`` (no token sent)."""
        return {"HF_ENDPOINT": self.url, "HF_HOME": str(home), "HF_HUB_CACHE": str(Path(home) / "hub"),
                "HF_HUB_OFFLINE": "1" if offline else "0", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip

    @contextlib.contextmanager
    def environment(self, home: str | Path, *, offline: bool = False) -> Iterator[None]:
        """This process uses this hub meanwhile: :meth:`env` set, and huggingface_hub's constants read from it at import."""
        from huggingface_hub import constants  # noqa: PLC0415

        env = self.env(home, offline=offline)
        values = {"ENDPOINT": self.url, "HUGGINGFACE_CO_URL_TEMPLATE": self.url + "/{repo_id}/resolve/{revision}/{filename}",
                  "HF_HOME": env["HF_HOME"], "HF_HUB_CACHE": env["HF_HUB_CACHE"], "HF_HUB_OFFLINE": offline,
                  "HF_HUB_DISABLE_IMPLICIT_TOKEN": True, "HF_TOKEN_PATH": str(Path(home) / "token"),
                  "HF_STORED_TOKENS_PATH": str(Path(home) / "stored_tokens")}  # fmt: skip
        saved_env = {k: os.environ.get(k) for k in env}
        saved = {k: getattr(constants, k) for k in values if hasattr(constants, k)}
        os.environ.update(env)
        for k, v in values.items():
            if k in saved:
                setattr(constants, k, v)
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(constants, k, v)
            for k, old in saved_env.items():
                if old is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = old

    # ------------------------------------------------------------------------- serving

    def _find(self, repo_id: str, revision: str) -> tuple[int, dict[str, str], _Revision | None]:
        with self._lock:
            revisions = dict(self._repos.get(repo_id, {}))
        if not revisions:
            return 401, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, None
        rev = revisions.get(revision) or next((r for r in revisions.values() if r.commit == revision), None)
        if rev is None:
            return 404, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}, None
        return 200, {}, rev

    def respond(self, method: str, raw_path: str, range_header: str | None) -> tuple[int, dict[str, str], bytes]:
        """``(status, headers, body)`` of a request (``raw_path``: the path and query, as sent)."""
        url = urlsplit(raw_path)
        with self._lock:
            self.requests.append((method, unquote(url.path)))
        query = parse_qs(url.query)
        if url.path.startswith("/api/models/"):
            rest = url.path[len("/api/models/") :]
            if "/tree/" in rest:
                repo, _, tail = rest.partition("/tree/")
                rev_name, _, sub = tail.partition("/")
                recursive = query.get("recursive", ["False"])[0].lower() == "true"
                return self._tree(unquote(repo), unquote(rev_name), unquote(sub), recursive)
            repo, _, rev_name = rest.partition("/revision/")
            return self._info(unquote(repo), unquote(rev_name) or "main")
        if "/resolve/" in url.path:
            repo, _, tail = url.path.lstrip("/").partition("/resolve/")
            rev_name, _, name = tail.partition("/")
            return self._file(unquote(repo), unquote(rev_name), unquote(name), method, range_header)
        return _json(404, {"error": "not a hub endpoint"})

    def _info(self, repo_id: str, revision: str) -> tuple[int, dict[str, str], bytes]:
        status, headers, rev = self._find(repo_id, revision)
        if rev is None:
            return _json(status, {"error": headers["X-Error-Message"]}, headers)
        return _json(200, {"id": repo_id, "modelId": repo_id, "sha": rev.commit, "private": False,
                           "siblings": [{"rfilename": n} for n in sorted(rev.files)]})  # fmt: skip

    def _tree(self, repo_id: str, revision: str, sub: str, recursive: bool) -> tuple[int, dict[str, str], bytes]:
        status, headers, rev = self._find(repo_id, revision)
        if rev is None:
            return _json(status, {"error": headers["X-Error-Message"]}, headers)
        prefix = f"{sub.strip('/')}/" if sub.strip("/") else ""
        entries: list[dict[str, Any]] = []
        folders: set[str] = set()
        for name in sorted(rev.files):
            if not name.startswith(prefix):
                continue
            inner = name[len(prefix) :]
            if "/" in inner and not recursive:
                folders.add(prefix + inner.split("/")[0])
                continue
            data = rev.files[name]
            entries.append({"type": "file", "path": name, "size": len(data), "oid": _git_blob_id(data)})
        entries += [{"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()} for d in sorted(folders)]
        return _json(200, entries)

    def _file(self, repo_id: str, revision: str, name: str, method: str, range_header: str | None) -> tuple[int, dict[str, str], bytes]:
        status, headers, rev = self._find(repo_id, revision)
        if rev is None:
            return _json(status, {"error": headers["X-Error-Message"]}, headers)
        data = rev.files.get(name)
        if data is None:
            return _json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found",
                                                             "X-Repo-Commit": rev.commit})  # fmt: skip
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": rev.commit,
                   "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}  # fmt: skip
        start = _range_start(range_header, len(data))
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return 206, headers, data[start:]
        return 200, headers, data


def _handler(hub: StandInHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, head: bool) -> None:
            status, headers, body = hub.respond(self.command, self.path, self.headers.get("Range"))
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(k, v)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self._answer(head=True)

        def do_GET(self) -> None:
            self._answer(head=False)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def _json(status: int, payload: Any, headers: Mapping[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(payload).encode()


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _range_start(header: str | None, size: int) -> int:
    """The first byte a ``Range: bytes=N-`` header asks for (0: the whole file)."""
    if not header or not header.startswith("bytes="):
        return 0
    first = header[len("bytes=") :].split("-", 1)[0]
    return int(first) if first.isdigit() and int(first) < size else 0


def _file_of(path: str) -> str:
    repo, _, tail = path.lstrip("/").partition("/resolve/")
    return f"{repo}/{tail.partition('/')[2]}"


__all__ = ["StandInHub"]
