"""A request id in every response, where the OpenAI and Anthropic SDKs look for one
(``x-request-id``, ``request-id``: their ``_request_id``), so a client's report names the
request a server log or a proxy saw."""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A proxy's id (nginx's $request_id, a load balancer's) is kept if it is a plain token;
# anything else (spaces, control characters, kilobytes) gets a fresh one.
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
HEADERS = (b"x-request-id", b"request-id")


def request_id(scope: Scope) -> bytes:
    """The id of the request: the client's ``x-request-id`` when it is a plain token of up to
    128 characters, else a new ``req_<32 hex digits>``."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"x-request-id" and _CLIENT_ID.fullmatch(value):
            return bytes(value)
    return b"req_" + uuid.uuid4().hex.encode()


def with_headers(send: Send, headers: list[tuple[bytes, bytes]]) -> Send:
    """``send`` with ``headers`` added to the response's start."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *headers]}
        await send(message)

    return sending


def id_headers(scope: Scope) -> dict[str, str]:
    """The headers naming the request of ``scope`` (none before the middleware ran): for the
    answer to an unhandled exception, which Starlette sends outside every middleware."""
    ident = scope.get("state", {}).get("request_id")
    return {} if ident is None else {name.decode(): ident.decode() for name in HEADERS}


class RequestIdMiddleware:
    """Answers every HTTP request with its id in ``x-request-id`` and ``request-id``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ident = request_id(scope)
        scope.setdefault("state", {})["request_id"] = ident
        await self.app(scope, receive, with_headers(send, [(name, ident) for name in HEADERS]))
