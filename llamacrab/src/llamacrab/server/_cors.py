"""CORS, outermost: a browser's preflight (``OPTIONS`` with ``Access-Control-Request-Method``)
carries no API key, so it is answered here, before authentication. An allowed origin (one of
``--cors-origin``, ``*`` for any, or a match of ``--cors-origin-regex``) gets the CORS headers;
any other origin gets an ordinary answer without them (the browser then refuses the call), not
an error. With no origin configured, CORS is off: no answer carries CORS headers."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_STATE_KEY = "cors_headers"


class CorsMiddleware(CORSMiddleware):
    def __init__(
        self, app: ASGIApp, origins: Sequence[str], origin_regex: str | None = None
    ) -> None:
        super().__init__(app, allow_origins=list(origins), allow_origin_regex=origin_regex,
                         allow_methods=["*"], allow_headers=["*"], max_age=600)  # fmt: skip

    def preflight_response(self, request_headers: Headers) -> Response:
        if self.is_allowed_origin(origin=request_headers["origin"]):
            return super().preflight_response(request_headers)
        return Response(status_code=204, headers={"Vary": "Origin"})

    async def simple_response(
        self, scope: Scope, receive: Receive, send: Send, request_headers: Headers
    ) -> None:
        # What this middleware adds to an answer, kept for the one it never sees: Starlette
        # answers an unhandled exception outside every middleware (cors_headers).
        start: Message = {"type": "http.response.start", "status": 500, "headers": []}
        await self.send(start, _keep, request_headers)
        scope.setdefault("state", {})[_STATE_KEY] = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in start["headers"]
        }
        await super().simple_response(scope, receive, send, request_headers)


async def _keep(message: Message) -> None:
    """A ``send`` that sends nothing: the headers stay on the message."""


def cors_headers(scope: Scope) -> dict[str, str]:
    """The CORS headers the answer to the request of ``scope`` carries (none where CORS is
    off or the request named no origin): for the answer to an unhandled exception."""
    headers: dict[str, str] = scope.get("state", {}).get(_STATE_KEY, {})
    return headers
