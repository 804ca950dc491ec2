"""A tiny Hugging Face Hub look-alike on loopback, for testing hub resolution with no network.

It answers what huggingface_hub needs to list and download model files: the repository tree
(``GET /api/models/{repo}/tree/{revision}``) and files (``HEAD``/``GET
/{repo}/resolve/{revision}/{path}`` with ``ETag`` and ``X-Repo-Commit``). Errors carry the
``X-Error-Code`` header the real Hub sends, so the client raises its usual exceptions.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    """Files per revision (branch name -> {path: bytes}); an optional token gates every access."""

    revisions: dict[str, dict[str, bytes]]
    token: str | None = None
    requests: list[str] = field(default_factory=list)

    def commit(self, revision: str) -> str:
        return hashlib.sha1(f"{id(self)}:{revision}".encode()).hexdigest()

    def find(self, revision: str) -> tuple[str, dict[str, bytes]] | None:
        for name, files in self.revisions.items():
            if revision in (name, self.commit(name)):
                return self.commit(name), files
        return None


# (method, URL path and query, status, body, headers) -> what to send instead
Tamper = Callable[[str, str, int, bytes, dict[str, str]], tuple[int, bytes, dict[str, str]]]


class HubServer:
    """Serve ``repos`` ({"org/name": Repo}) on 127.0.0.1 until ``close()``. ``tamper``, when
    set, rewrites every answer before it is sent (its Content-Length too, if it sets one): a
    hostile hub."""

    def __init__(self, repos: dict[str, Repo]) -> None:
        self.repos = repos
        self.tamper: Tamper | None = None
        self.authorizations: list[str] = []  # the Authorization header of every request
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


_TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep test output clean

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, send_body: bool) -> None:
        self.hub.authorizations.append(self.headers.get("Authorization", ""))
        path = unquote(urlparse(self.path).path)
        tree, resolve = _TREE.match(path), _RESOLVE.match(path)
        match = tree or resolve
        if match is None:
            return self._error(404, "RepoNotFound", "no such route")
        repo = self.hub.repos.get(match.group(1))
        if repo is None:
            return self._error(404, "RepoNotFound", f"repository {match.group(1)} not found")
        repo.requests.append(f"{self.command} {path}")
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            return self._error(401, "GatedRepo", "this repository is gated: pass a token")
        found = repo.find(match.group(2))
        if found is None:
            return self._error(404, "RevisionNotFound", f"revision {match.group(2)} not found")
        commit, files = found
        if tree:
            listing = [
                {"type": "file", "path": name, "size": len(data),
                 "oid": hashlib.sha1(data).hexdigest()}
                for name, data in sorted(files.items())
            ]  # fmt: skip
            return self._send(200, json.dumps(listing).encode(), "application/json", send_body)
        data = files.get(match.group(3))
        if data is None:
            return self._error(404, "EntryNotFound", f"{match.group(3)} not found")
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": commit}
        self._send(200, data, "application/octet-stream", send_body, headers)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        headers = {"X-Error-Code": code, "X-Error-Message": message}
        self._send(status, body, "application/json", True, headers)

    def _send(
        self,
        status: int,
        body: bytes,
        content_type: str,
        send_body: bool,
        headers: dict[str, str] | None = None,
    ) -> None:
        headers = {"Content-Type": content_type, **(headers or {})}
        if self.hub.tamper is not None:
            status, body, headers = self.hub.tamper(self.command, self.path, status, body, headers)
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        if send_body:
            self.wfile.write(body)
