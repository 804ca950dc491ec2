"""Forwarding one request to an isolated entry's process (server/_isolation.py) and its answer
back unchanged, streamed as it comes (server-sent events too). The parent's checks (API key,
body size) ran before; the child gets its own key instead of the client's. The blocking calls
run on the model's own worker threads (``threads``), never on those the other routes share."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import socket

from anyio import CapacityLimiter, to_thread
from starlette.types import Receive, Scope, Send

from llamacrab.server import _anthropic_wire
from llamacrab.server._errors import ANTHROPIC_PATH, ApiError
from llamacrab.server._isolation import ChildModel
from llamacrab.server._sse import sse_json

# Hop-by-hop headers, and the client's credentials (the child takes the parent's key).
_DROPPED_REQUEST = {b"host", b"authorization", b"x-api-key", b"content-length", b"connection",
                    b"transfer-encoding", b"keep-alive", b"upgrade", b"te"}  # fmt: skip
_DROPPED_ANSWER = {"connection", "transfer-encoding", "keep-alive", "server", "date"}
_CHUNK = 64 * 1024


async def forward(child: ChildModel, scope: Scope, body: bytes, receive: Receive, send: Send,
                  timeout: float, threads: CapacityLimiter) -> None:  # fmt: skip
    """Send the request to ``child`` and its answer to the client. Raises ApiError (502) when
    the child cannot answer before the answer started. A whole answer (not an event stream) is
    read in full before it is sent, so a child dying mid-answer is a 502 too; a broken event
    stream ends with an error event."""
    target = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
               if k.lower() not in _DROPPED_REQUEST}  # fmt: skip
    headers["authorization"] = f"Bearer {child.key}"
    connection = http.client.HTTPConnection(*child.address, timeout=timeout)
    gone = asyncio.create_task(_client_gone(receive, connection))
    try:
        try:
            answer = await to_thread.run_sync(_open, connection, scope["method"],
                                              target.decode("latin-1"), body, headers,
                                              limiter=threads)  # fmt: skip
            events = (answer.getheader("content-type") or "").startswith("text/event-stream")
            whole = b"" if events else await to_thread.run_sync(answer.read, limiter=threads)
        except (OSError, http.client.HTTPException) as error:
            if gone.done():
                return  # the client left (which broke the connection): no one to answer
            raise ApiError(502, await _broken(child, error, threads), param="model",
                           code="model_process_failed") from None  # fmt: skip
        await send({"type": "http.response.start", "status": answer.status,
                    "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                for k, v in answer.getheaders()
                                if k.lower() not in _DROPPED_ANSWER]})  # fmt: skip
        if events:
            await _stream(child, scope["path"], answer, gone, send, threads)
        await send({"type": "http.response.body", "body": whole})
    finally:
        gone.cancel()
        connection.close()


async def _stream(child: ChildModel, path: str, answer: http.client.HTTPResponse,
                  gone: asyncio.Task[None], send: Send,
                  threads: CapacityLimiter) -> None:  # fmt: skip
    """Pass an event stream on as it comes; when the child breaks it, end it with an error
    event (unless the client left, which broke it: then it just ends)."""
    while True:
        try:
            chunk = await to_thread.run_sync(answer.read1, _CHUNK, limiter=threads)
        except (OSError, http.client.HTTPException) as error:
            if gone.done():
                return
            why = await _broken(child, error, threads)
            broken = ApiError(502, why, code="model_process_failed")
            chunk = _error_event(path, broken).encode()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            return
        if not chunk:
            return
        await send({"type": "http.response.body", "body": chunk, "more_body": True})


def _error_event(path: str, error: ApiError) -> str:
    """The event that ends a broken stream, as the route's API ends one: Anthropic's ``error``
    event (its SDK ignores a nameless one, and the answer would end silently cut), else
    OpenAI's ``data: {"error": ...}``, which its SDK raises on every route."""
    if path == ANTHROPIC_PATH:
        return _anthropic_wire.error_event(error)
    return f"data: {sse_json(error.body())}\n\n"


def _open(connection: http.client.HTTPConnection, method: str, target: str, body: bytes,
          headers: dict[str, str]) -> http.client.HTTPResponse:  # fmt: skip
    connection.request(method, target, body or None, headers)
    return connection.getresponse()


async def _client_gone(receive: Receive, connection: http.client.HTTPConnection) -> None:
    """When the client disconnects, break the child's connection: it stops generating."""
    while (await receive())["type"] != "http.disconnect":
        pass
    if connection.sock is not None:
        with contextlib.suppress(OSError):
            connection.sock.shutdown(socket.SHUT_RDWR)


async def _broken(child: ChildModel, error: Exception, threads: CapacityLimiter) -> str:
    """Why the child's answer broke: how its process ended, if it did."""
    # The connection breaks first; the exit and ggml's last line come soon after.
    if await to_thread.run_sync(child.wait, 5, limiter=threads):
        return f"model {child.name!r}: its process {child.ended()}"
    return f"model {child.name!r}: its process did not answer ({type(error).__name__}: {error})"
