"""Errors as OpenAI shapes them: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from llamacrab._exceptions import (
    ClosedHandleError,
    ContextOverflowError,
    LlamaError,
    QueueFullError,
)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 503: "server_error", 504: "timeout_error"}  # fmt: skip


class ApiError(Exception):
    """An error answered with ``status`` and OpenAI's error body."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request")
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}


def from_llama_error(error: LlamaError) -> ApiError:
    """The status a library error deserves: bad input 400, busy 503, the rest 500."""
    if isinstance(error, ContextOverflowError):
        return ApiError(400, str(error), code="context_length_exceeded")
    if isinstance(error, QueueFullError):
        return ApiError(503, str(error), code="server_busy")
    if isinstance(error, ClosedHandleError):
        return ApiError(503, "the server is shutting down", code="shutting_down")
    if isinstance(error, ValueError):  # InvalidParameterError, GrammarError, TemplateError, ...
        return ApiError(400, str(error))
    return ApiError(500, f"{type(error).__name__}: {error}")
