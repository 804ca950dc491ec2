"""Large JSON request bodies read away from the event loop. FastAPI parses and validates a route's
body on the loop, where an 8 MiB body of small objects held every other request (``/health``
too) for seconds. Past OFF_LOOP_BYTES a worker thread does both, and so do the middlewares that
read the body before the route; the value it validated reaches the route as it is."""

from __future__ import annotations

import asyncio
import email.message
import gc
import json
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import params
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

OFF_LOOP_BYTES = 64 << 10  # a body this small parses in well under a millisecond

_T = TypeVar("_T")


def loads(body: bytes, **hooks: Any) -> Any:
    """``json.loads``, with a Python call for each object: the C parser holds the GIL until it
    is done, and only running Python code lets the loop's thread take it meanwhile."""
    return json.loads(body, object_hook=_same, **hooks)


def _same(value: dict[str, Any]) -> dict[str, Any]:
    return value


async def read_off_loop(body: bytes, read: Callable[[], _T]) -> _T:
    """``read()`` (of ``body``) here for a small body, in a worker thread for a large one."""
    if len(body) <= OFF_LOOP_BYTES:
        return read()
    return await asyncio.to_thread(_collector_paused, read)


_paused_lock = threading.Lock()
_paused_reads = 0
_collector_was_enabled = False


def _collector_paused(read: Callable[[], _T]) -> _T:
    """``read()`` with no garbage collection (until the last such read ends): the millions of
    objects a large body makes start full collections over a growing heap, which took most of
    a parse and held the GIL (every thread) for half a second at a time."""
    global _paused_reads, _collector_was_enabled
    with _paused_lock:
        if _paused_reads == 0:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _paused_reads += 1
    try:
        return read()
    finally:
        with _paused_lock:
            _paused_reads -= 1
            if _paused_reads == 0 and _collector_was_enabled:
                gc.enable()


def _after_fork_in_child() -> None:
    """A child forked during reads has none of their threads: its lock free, and its collector
    as it was before them (else disabled for good)."""
    global _paused_reads
    _paused_lock._at_fork_reinit()  # type: ignore[attr-defined]
    if _paused_reads:
        _paused_reads = 0
        if _collector_was_enabled:
            gc.enable()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


class JsonBodyRoute(APIRoute):
    """A route whose large JSON body is parsed and validated in a worker thread; FastAPI then
    finds the validated value, which it takes as it is."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        fields = self.dependant.body_params
        if len(fields) != 1 or isinstance(fields[0].field_info, params.Form):
            return handler
        if getattr(fields[0].field_info, "embed", False):
            return handler  # FastAPI validates each embedded field apart
        field = fields[0]

        async def read_then_answer(request: Request) -> Response:
            body = await request.body()
            if len(body) > OFF_LOOP_BYTES and _declares_json(request):
                value, errors = await read_off_loop(body, lambda: _validated(body, field))
                if errors:
                    raise RequestValidationError(errors)
                request = _ReadRequest(request, body, value)
            return await handler(request)

        return read_then_answer


def _declares_json(request: Request) -> bool:
    """Whether FastAPI parses the body as JSON: its Content-Type says so (FastAPI's test)."""
    declared = request.headers.get("content-type")
    if not declared:
        return False
    message = email.message.Message()
    message["content-type"] = declared
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _validated(body: bytes, field: Any) -> tuple[Any, list[Any]]:
    """The route's body value and the problems FastAPI finds in it; a body that is not JSON
    raises what FastAPI raises for it. What was parsed is freed here, in this thread: freeing
    millions of objects holds the GIL too."""
    try:
        parsed = loads(body)
    except json.JSONDecodeError as error:
        problem = {"type": "json_invalid", "loc": ("body", error.pos), "msg": "JSON decode error",
                   "input": {}, "ctx": {"error": error.msg}}  # fmt: skip
        raise RequestValidationError([problem], body=error.doc) from None
    except Exception as error:  # not UTF-8, nested too deep: as FastAPI answers them
        raise HTTPException(400, "There was an error parsing the body") from error
    return field.validate(parsed, {}, loc=("body",))  # type: ignore[no-any-return]


class _ReadRequest(Request):
    """A request whose body was read and validated already."""

    def __init__(self, request: Request, body: bytes, value: Any) -> None:
        super().__init__(request.scope, request.receive)
        self._read, self._value = body, value

    async def body(self) -> bytes:
        return self._read

    async def json(self) -> Any:
        return self._value
