"""ASGI middleware: API keys, the request body's limit and JSON, and per-request metrics."""

from __future__ import annotations

import hmac
import json
import math
import re
import time
from collections.abc import Sequence
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llamacrab.server._errors import CLIENT_CLOSED, ApiError, error_response
from llamacrab.server._json_body import loads, read_off_loop
from llamacrab.server._metrics import UNMATCHED_ROUTE, Metrics


async def answer_early(scope: Scope, send: Send, error: ApiError) -> None:
    """Answer ``error`` from a middleware, before any route runs."""
    answer = error_response(scope["path"], error)
    await send({"type": "http.response.start", "status": answer.status_code,
                "headers": answer.raw_headers})  # fmt: skip
    await send({"type": "http.response.body", "body": answer.body})


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
            await answer_early(scope, send, ApiError(401, message, code="invalid_api_key"))
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses (413) a request body over ``limit`` bytes, declared or streamed, and (400) a JSON
    body that only Python's parser takes (see ``json_problem``)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = ApiError(413, f"the request body exceeds {self.limit} bytes")
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await answer_early(scope, send, too_large)
            return
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                await answer_early(scope, send, too_large)
                return
            if not message.get("more_body"):
                break
        body = b"".join(parts)
        if _is_json(scope) and (problem := await read_off_loop(body, lambda: json_problem(body))):
            await answer_early(
                scope, send, ApiError(400, f"the request body is not valid JSON: {problem}")
            )
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: the disconnect a streaming response listens for

        await self.app(scope, replay, send)


def _is_json(scope: Scope) -> bool:
    """Whether the routes parse the body as JSON (FastAPI does without a content type too)."""
    kind = (_header(scope, b"content-type") or b"").split(b";")[0].strip().lower()
    return kind in (b"", b"application/json") or kind.endswith(b"+json")


# What could make Python's json module accept a body that JSON (RFC 8259) does not: a surrogate
# escape, NaN / Infinity, a three-digit exponent. Only a body holding one is parsed here.
_SUSPECT = re.compile(rb"\\u[dD][89a-fA-F]|NaN|Infinity|[eE][+-]?[0-9]{3}")
# Searched 64 KiB at a time (overlapping by the longest match): the search holds the GIL, and a
# 20 MB body in one search held every thread for most of a second.
_SEARCHED = 64 << 10
_LONGEST_SUSPECT = len(b"Infinity")


def _suspect(body: bytes) -> bool:
    return any(
        _SUSPECT.search(body, start, start + _SEARCHED + _LONGEST_SUSPECT)
        for start in range(0, len(body), _SEARCHED)
    )


class _NotJson(ValueError):
    pass


def _no_constant(name: str) -> float:
    raise _NotJson(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotJson(f"the number {text[:40]} is beyond a double's range")
    return value


def json_problem(body: bytes) -> str | None:
    """What makes ``body`` invalid JSON that Python's json module parses anyway: NaN or
    Infinity, a number past a double (parsed as inf), a string with an unpaired surrogate
    escape (no UTF-8 can carry it, so it fails later, wherever it is encoded). None when the
    body is fine, or malformed in a way the route's own parse reports."""
    if not _suspect(body):
        return None
    try:
        parsed = loads(body, parse_constant=_no_constant, parse_float=_finite)
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")
    except _NotJson as error:
        return str(error)
    except UnicodeEncodeError as error:
        return f"a string holds an unpaired surrogate {error.object[error.start]!r}"
    except (ValueError, RecursionError):
        return None
    return None


def content_type_problem(headers: Headers, errors: Sequence[Any]) -> str | None:
    """Why a body was not read at all, when its Content-Type is the reason: JSON is parsed only
    when declared (``curl -d`` sends a form type), so that a web page cannot post to a server on
    this machine without the browser's CORS check, which the plain types skip."""
    declared = headers.get("content-type", "")
    if declared.split(";")[0].strip().lower().endswith(("/json", "+json")):
        return None
    if not any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return None
    return (f"the body was not read as JSON: its Content-Type is {declared or 'missing'!r}; "
            "send Content-Type: application/json")  # fmt: skip


def route_template(scope: Scope) -> str:
    """The path of the route the router matched (it records it in the scope), e.g.
    ``/v1/chat/completions``; ``unmatched`` when none did. Never the request's own path: that
    would let clients grow the metrics' label set without bound."""
    path = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) and path else UNMATCHED_ROUTE


class MetricsMiddleware:
    """Counts each answered request by route template and status, with its duration. One left
    unanswered counts as CLIENT_CLOSED where its client was seen leaving (a request forwarded
    to an isolated model then ends without an answer), else as 500 (a bug: Starlette answers
    it outside). An unhandled error raised after its client left counts as CLIENT_CLOSED too:
    nothing here tells it from a request that ended because its client left."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status, gone = time.perf_counter(), None, False

        async def listen() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, listen, watch)
        finally:
            if status is None:
                status = CLIENT_CLOSED if gone else 500
            self.metrics.request_done(route_template(scope), status, time.perf_counter() - started)
