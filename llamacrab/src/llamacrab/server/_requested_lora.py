"""The LoRA scales the request being answered asked for (its ``lora`` field, where they differ
from the server's default scales): logits that overflow under them (NaN, the library's
DecodeError of status 0) come from the client's input, a 400 naming them, where the same error
under the server's own scales is a 500. Recorded where
a route reads the field (``_lora.request_lora``, on the request's task or a worker thread of
it), read where a library error becomes an answer (``_errors.from_llama_error``), without
threading the field through every route."""

from __future__ import annotations

from contextvars import ContextVar

from starlette.types import ASGIApp, Receive, Scope, Send

# Each request runs in a task of its own, whose context its worker threads copy: the list set
# here is the same object there, and never another request's.
_ASKED: ContextVar[list[tuple[int, float]] | None] = ContextVar("requested_lora", default=None)


class RequestedLoraMiddleware:
    """Gives each request an empty record of the scales it asks for."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        _ASKED.set([])
        await self.app(scope, receive, send)


def ask_for(scales: dict[int, float]) -> None:
    """The request being answered asked for these scales, by adapter id (other than the
    server's defaults)."""
    asked = _ASKED.get()
    if asked is not None:
        asked[:] = [(index, scale) for index, scale in scales.items() if scale != 0]


def requested_scales() -> list[tuple[int, float]]:
    """The nonzero scales the request being answered asked for (none: the server's own)."""
    return list(_ASKED.get() or ())
