"""Responses stored by isolated entries: each entry's process (server/_isolation.py) keeps the
responses it answered in a store of its own, while the routes of a stored response name no
model and run in the server. Where the server's store lacks an id, it asks the children
loaded now (never loading one), all at once, and passes on the answer of the one that has it."""

from __future__ import annotations

import http.client
from functools import partial
from typing import NamedTuple
from urllib.parse import quote, urlencode

from anyio import CapacityLimiter, create_task_group, to_thread
from starlette.requests import Request
from starlette.responses import Response

from llamacrab import ModelRegistry
from llamacrab.server._isolation import ChildModel

# A child answers these from memory; one that does not within this is skipped (a hung one
# must not hold every lookup of an unknown id for long).
_TIMEOUT = 3.0


class _Answer(NamedTuple):
    child: ChildModel
    status: int
    body: bytes


class ChildLookups:
    """Asks the loaded children of ``registry`` for a stored response, on threads of its own
    (a hung child must not hold the ones every other route shares)."""

    def __init__(self, registry: ModelRegistry | None, threads: int = 64) -> None:
        self.registry = registry
        self.threads = CapacityLimiter(threads)

    async def answer(self, request: Request) -> Response | None:
        """``request`` (a route of one stored response) as the child that stores the response
        answers it, None when no child does. Its own query parameters go on, not ``model``:
        the child serves one model under another name (the parent's ``?model=`` is unknown
        there)."""
        path = request.scope.get("raw_path") or quote(request.url.path).encode()
        target = path.decode("latin-1")
        kept = [(k, v) for k, v in request.query_params.multi_items() if k != "model"]
        if kept:
            target += "?" + urlencode(kept)
        found = await self._ask(request.method, target)
        if found is None:
            return None
        return Response(found.body, found.status, media_type="application/json")

    async def holder(self, response_id: str) -> str | None:
        """The model whose process stores ``response_id``, None when no loaded child does."""
        found = await self._ask("GET", f"/v1/responses/{quote(response_id, safe='')}")
        return found.child.name if found is not None and found.status == 200 else None

    async def _ask(self, method: str, target: str) -> _Answer | None:
        """The answer, neither a 404 nor a 5xx, of a loaded child to ``method target``. A child
        that ends, hangs or fails meanwhile is skipped: it has nothing to give (a 5xx of one
        shutting down must not hide the one that holds the response)."""
        loaded = self.registry.loaded_models() if self.registry is not None else []
        children = [m for m in loaded if isinstance(m, ChildModel)]
        answers: list[_Answer] = []

        async def ask(child: ChildModel) -> None:
            call = partial(child.request, method, target, timeout=_TIMEOUT)
            try:
                status, body = await to_thread.run_sync(call, limiter=self.threads)
            except (OSError, http.client.HTTPException):
                return
            if status != 404 and status < 500:
                answers.append(_Answer(child, status, body))

        async with create_task_group() as group:
            for child in children:
                group.start_soon(ask, child)
        return answers[0] if answers else None
