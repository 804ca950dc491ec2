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
from starlette.types import ASGIApp


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
