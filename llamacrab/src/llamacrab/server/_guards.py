"""ASGI middleware: API keys, the request body limit, and per-request metrics."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llamacrab.server._errors import ApiError, error_body
from llamacrab.server._metrics import UNMATCHED_ROUTE, Metrics


async def _answer(scope: Scope, send: Send, error: ApiError) -> None:
    body = json.dumps(error_body(scope["path"], error)).encode()
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


def _presented_keys(scope: Scope) -> list[bytes]:
    """The keys a request presents: ``Authorization: Bearer <key>`` (OpenAI's clients) and
    ``x-api-key: <key>`` (Anthropic's)."""
    keys = []
    scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
    if scheme.lower() == b"bearer":
        keys.append(token.strip())
    if (api_key := _header(scope, b"x-api-key")) is not None:
        keys.append(api_key.strip())
    return keys


class AuthMiddleware:
    """Every route but ``open_paths`` needs one of ``keys``, as ``Authorization: Bearer <key>``
    or ``x-api-key: <key>``."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], open_paths: Sequence[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.open_paths = set(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        valid = any(
            hmac.compare_digest(given, key) for given in _presented_keys(scope) for key in self.keys
        )
        if not valid:
            message = "missing or invalid API key (send Authorization: Bearer <key> or x-api-key)"
            await _answer(scope, send, ApiError(401, message, code="invalid_api_key"))
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
            await _answer(scope, send, too_large)
            return
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                await _answer(scope, send, too_large)
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
