"""Responses stored by isolated entries: each entry's process (server/_isolation.py) keeps the
responses it answered in a store of its own, while the routes of a stored response name no
model and run in the server. Where the server's store lacks an id, it asks the children
loaded now (never loading one) and passes the answer of the one that has it on unchanged."""

from __future__ import annotations

import http.client
from functools import partial
from typing import NamedTuple
from urllib.parse import quote

from anyio import to_thread
from starlette.requests import Request
from starlette.responses import Response

from llamacrab import ModelRegistry
from llamacrab.server._isolation import ChildModel

_TIMEOUT = 10.0  # a child answers these from memory; one that does not is skipped


class _Answer(NamedTuple):
    child: ChildModel
    status: int
    body: bytes


async def _ask_children(registry: ModelRegistry | None, method: str,
                        target: str) -> _Answer | None:  # fmt: skip
    """The first answer other than 404 of the loaded children to ``method target``, None when
    none has one. A child that ends or hangs meanwhile is skipped: it holds nothing to give."""
    loaded = registry.loaded_models() if registry is not None else []
    for child in (m for m in loaded if isinstance(m, ChildModel)):
        ask = partial(child.request, method, target, timeout=_TIMEOUT)
        try:
            status, body = await to_thread.run_sync(ask)  # blocking: off the event loop
        except (OSError, http.client.HTTPException):
            continue
        if status != 404:
            return _Answer(child, status, body)
    return None


async def child_answer(registry: ModelRegistry | None, request: Request) -> Response | None:
    """``request`` (a route of one stored response) as the child that stores the response
    answers it (query string kept), None when no child does."""
    target = (request.scope.get("raw_path") or request.url.path.encode()).decode("latin-1")
    if request.url.query:
        target += "?" + request.url.query
    answer = await _ask_children(registry, request.method, target)
    if answer is None:
        return None
    return Response(answer.body, answer.status, media_type="application/json")


async def holder(registry: ModelRegistry | None, response_id: str) -> str | None:
    """The model whose process stores ``response_id``, None when no loaded child does."""
    target = f"/v1/responses/{quote(response_id, safe='')}"
    answer = await _ask_children(registry, "GET", target)
    return answer.child.name if answer is not None and answer.status == 200 else None
