"""ASGI middleware: API keys, the request body limit, and per-request metrics."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llamacrab.server._errors import ApiError
from llamacrab.server._metrics import UNMATCHED_ROUTE, Metrics


async def _answer(send: Send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


class AuthMiddleware:
    """Every route but ``open_paths`` needs ``Authorization: Bearer <one of keys>``."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], open_paths: Sequence[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.open_paths = set(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization") or b""
        scheme, _, token = given.partition(b" ")
        valid = scheme.lower() == b"bearer" and any(
            hmac.compare_digest(token.strip(), key) for key in self.keys
        )
        if not valid:
            message = "missing or invalid API key (send Authorization: Bearer <key>)"
            await _answer(send, ApiError(401, message, code="invalid_api_key"))
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses (413) a request body over ``limit`` bytes, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = ApiError(413, f"the request body exceeds {self.limit} bytes")
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await _answer(send, too_large)
            return
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                await _answer(send, too_large)
                return
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            return await receive()  # later: the disconnect a streaming response listens for

        await self.app(scope, replay, send)


def route_template(scope: Scope) -> str:
    """The path of the route the router matched (it records it in the scope), e.g.
    ``/v1/chat/completions``; ``unmatched`` when none did. Never the request's own path: that
    would let clients grow the metrics' label set without bound."""
    path = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) and path else UNMATCHED_ROUTE


class MetricsMiddleware:
    """Counts each answered request by route template and status, with its duration."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self.metrics.request_done(route_template(scope), status, time.perf_counter() - started)
