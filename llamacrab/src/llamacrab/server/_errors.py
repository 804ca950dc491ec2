"""Errors as OpenAI shapes them: ``{"error": {"message", "type", "param", "code"}}``, and on
Anthropic's Messages routes as Anthropic does: ``{"type": "error", "error": {"type",
"message"}}``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from starlette.responses import JSONResponse

from llamacrab._exceptions import (
    ClosedHandleError,
    ContextOverflowError,
    DecodeError,
    LlamaError,
    QueueFullError,
)
from llamacrab.server._requested_lora import requested_scales

# 409: a slot busy generating; llama-server calls a resource busy for now "unavailable".
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "unavailable_error", 413: "invalid_request_error", 503: "server_error",
          504: "timeout_error"}  # fmt: skip
# Anthropic's Messages API lives under this path; its clients expect its own error shape.
ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error",
                    504: "timeout_error"}  # fmt: skip


class ApiError(Exception):
    """An error answered with ``status`` and OpenAI's error body (plus ``details``: fields
    llama-server adds, such as ``n_prompt_tokens`` and ``n_ctx`` for a context overflow).
    ``kind``: the body's ``type`` where the status's usual one is not it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        details: dict[str, Any] | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.details, self.kind = details or {}, kind

    @property
    def headers(self) -> dict[str, str]:
        """``x-should-retry: false`` where asking again gets the same answer (a timeout, a bug, an
        unsupported call, a model that failed to load): the OpenAI and Anthropic SDKs retry
        any other 5xx twice, holding a slot each time. A 401 names the scheme it wants."""
        transient = self.status in (502, 503) and self.code != "load_failed"
        if self.status == 401:
            return {"www-authenticate": "Bearer"}
        return {"x-should-retry": "false"} if self.status >= 500 and not transient else {}

    def body(self) -> dict[str, Any]:
        kind = self.kind or _TYPES.get(
            self.status, "server_error" if self.status >= 500 else _TYPES[400]
        )
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": {**error, **self.details}}


def anthropic_body(error: ApiError) -> dict[str, Any]:
    """``error`` in the shape of Anthropic's API."""
    fallback = "api_error" if error.status >= 500 else "invalid_request_error"
    kind = _ANTHROPIC_TYPES.get(error.status, fallback)
    details = {"details": error.details} if error.details else {}
    return {"type": "error", "error": {"type": kind, "message": error.message, **details}}


def anthropic_status(error: ApiError) -> int:
    """The status Anthropic answers ``error`` with: 529 for a server too busy to take the
    request (its ``overloaded_error``; the SDK raises OverloadedError and backs off)."""
    return 529 if error.code == "server_busy" else error.status


def error_response(path: str, error: ApiError) -> JSONResponse:
    """The answer to ``error`` in the shape of the API that ``path`` belongs to (an unknown
    route under /v1/messages answers as Anthropic does). Every error answer is written here:
    one JSON spelling (compact, UTF-8), whether a route, a handler or a middleware answers
    (an error event inside a stream is written as the stream's other events are)."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return JSONResponse(anthropic_body(error), anthropic_status(error), error.headers)
    return JSONResponse(error.body(), error.status, error.headers)


def invalid_body(problems: Sequence[Mapping[str, Any]]) -> ApiError:
    """A request body that does not validate (pydantic's problems): each named by its field,
    ``param`` the first one's, as OpenAI names it."""
    described, fields = [], []
    for problem in problems:
        where = ".".join(str(part) for part in problem["loc"][1:])
        if problem["type"] == "json_invalid":  # where: the character the parser stopped at
            detail = (problem.get("ctx") or {}).get("error", problem["msg"])
            described.append(f"the body is not valid JSON (at character {where}): {detail}")
            continue
        fields.append(where)
        unknown = problem["type"] == "extra_forbidden"
        message = "not supported by this server" if unknown else problem["msg"]
        described.append(f"{where or 'body'}: {message}")
    return ApiError(400, "; ".join(described), param=next((f for f in fields if f), None))


def unknown_url(method: str, path: str) -> ApiError:
    """404 for a path no route has (OpenAI's code for it: ``unknown_url``)."""
    hint = " (no route ends with a slash)" if path.endswith("/") and path != "/" else ""
    return ApiError(404, f"unknown request URL: {method} {path}{hint}", code="unknown_url")


def model_closed() -> ApiError:
    """A request whose model closed (or cancelled it) under it: the server stops, or (several
    models) a forced unload."""
    return ApiError(503, "the model was closed while this request used it: the server is "
                    "shutting down or the model was unloaded", code="shutting_down")  # fmt: skip


# nginx's status for a request whose client closed the connection before the answer: it is
# never sent (no one reads it), but counted, and a 5xx would blame the server.
CLIENT_CLOSED = 499


def client_closed() -> ApiError:
    """A request whose client left before its answer (its generation was stopped)."""
    return ApiError(CLIENT_CLOSED, "the client closed the connection before the answer",
                    code="client_closed")  # fmt: skip


def _context_overflow(error: ContextOverflowError) -> ApiError:
    """llama-server's answer to a request too long for the context: its type, its message
    (clients match either) with the reason after it, ``n_prompt_tokens`` and ``n_ctx``; and
    OpenAI's code."""
    n, n_ctx = error.n_prompt_tokens, error.n_ctx
    message = str(error)
    if n is not None and n_ctx is not None:
        message = (f"request ({n} tokens) exceeds the available context size ({n_ctx} tokens), "
                   f"try increasing it ({message})")  # fmt: skip
    sizes = {"n_prompt_tokens": n, "n_ctx": n_ctx}
    return ApiError(400, message, code="context_length_exceeded",
                    details={k: v for k, v in sizes.items() if v is not None},
                    kind="exceed_context_size_error")  # fmt: skip


def from_llama_error(error: LlamaError) -> ApiError:
    """The status a library error deserves: bad input 400 (logits that overflowed under the
    request's own LoRA scales too), busy 503, the rest 500."""
    if isinstance(error, ContextOverflowError):
        return _context_overflow(error)
    if isinstance(error, QueueFullError):
        return ApiError(503, str(error), code="server_busy")
    if isinstance(error, ClosedHandleError):
        return model_closed()
    if isinstance(error, DecodeError) and error.status == 0 and requested_scales():
        scales = ", ".join(f"adapter {index} at scale {scale:g}"
                           for index, scale in requested_scales())  # fmt: skip
        return ApiError(400, f"the model's logits overflowed (NaN) with the LoRA scales this "
                        f"request asked for ({scales}): ask for smaller ones", param="lora",
                        code="lora_scale_overflow")  # fmt: skip
    if isinstance(error, ValueError):  # InvalidParameterError, GrammarError, TemplateError, ...
        return ApiError(400, str(error))
    return ApiError(500, f"{type(error).__name__}: {error}")
