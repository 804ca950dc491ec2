"""The model a request names, read before its route runs (the multi-model form leases it): the
``model`` of a JSON body, else of a form body (``/v1/audio/transcriptions``), else the last
``?model=``, each as the route itself reads it."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from python_multipart import MultipartParser
from python_multipart.multipart import parse_options_header
from starlette.types import Scope

from llamacrab.server._json_body import loads

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

# Past Starlette's limits for the route's own form (1000 fields and 1000 files, a field of
# 1 MiB), which refuses it: the model named there is not read.
_MAX_FORM_PARTS = 2000
_MAX_FIELD_BYTES = 1 << 20


def requested_model(scope: Scope, body: bytes) -> str | None:
    """The ``model`` of a JSON body, else of a form body (``/v1/audio/transcriptions``), else
    of the query string."""
    query = scope.get("query_string", b"")
    return _json_model(body) or _form_model(scope, body) or _last_model(query)


def _json_model(body: bytes) -> str | None:
    try:
        data = loads(body) if body else None
    except (ValueError, RecursionError):
        return None  # the route answers the malformed body (or one nested too deep)
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) and model else None


def _last_model(query: bytes, max_fields: int | None = None) -> str | None:
    """The last ``model`` of a query string or an urlencoded form, as Starlette reads it for
    the route (the first leased one model while the route used another: a 500 for an isolated
    one). None past ``max_fields``."""
    try:
        parsed = parse_qs(query.decode("latin-1"), keep_blank_values=True,
                          max_num_fields=max_fields)  # fmt: skip
    except ValueError:  # counted before anything is parsed
        return None
    values = parsed.get("model")
    return values[-1] or None if values else None


def _form_model(scope: Scope, body: bytes) -> str | None:
    """The ``model`` field of a form body, the one the route reads. A multipart body is parsed
    in one linear pass that keeps that field alone: a file's bytes pass unread."""
    content_type = next((v for k, v in scope.get("headers", ()) if k == b"content-type"), b"")
    mime, options = parse_options_header(content_type)
    if mime == b"application/x-www-form-urlencoded":
        return _last_model(body, _MAX_FORM_PARTS)
    if mime != b"multipart/form-data" or b"boundary" not in options:
        return None
    field = _ModelField()
    try:
        MultipartParser(options[b"boundary"], field.callbacks()).write(body)
    except ValueError:  # python-multipart's FormParserError: the route answers the bad form
        return None
    except _RefusedForm:
        return None
    return field.value or None


class _RefusedForm(Exception):
    """A form the route refuses (more parts, or a longer field, than Starlette reads): reading
    on would only cost (200k empty parts took 1.4 s of the event loop)."""


class _ModelField:
    """Multipart callbacks keeping the last ``model`` field that is not a file, decoded as
    Starlette decodes it (UTF-8, else Latin-1)."""

    def __init__(self) -> None:
        self.value: str | None = None
        self._name = self._text = self._disposition = b""
        self._data: bytearray | None = None  # while in a ``model`` field: its bytes
        self._parts = 0

    def callbacks(self) -> MultipartCallbacks:
        return {"on_part_begin": self._counted,
                "on_header_field": self._header_name, "on_header_value": self._header_value,
                "on_header_end": self._header_end, "on_headers_finished": self._part_start,
                "on_part_data": self._part_data, "on_part_end": self._part_end}  # fmt: skip

    def _counted(self) -> None:
        self._parts += 1
        if self._parts > _MAX_FORM_PARTS:
            raise _RefusedForm

    def _header_name(self, data: bytes, start: int, end: int) -> None:
        self._name += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._text += data[start:end]

    def _header_end(self) -> None:
        if self._name.lower() == b"content-disposition":
            self._disposition = self._text
        self._name = self._text = b""

    def _part_start(self) -> None:
        _, options = parse_options_header(self._disposition)
        wanted = options.get(b"name") == b"model" and b"filename" not in options
        self._data = bytearray() if wanted else None
        self._disposition = b""

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._data is not None:
            self._data += data[start:end]
            if len(self._data) > _MAX_FIELD_BYTES:
                raise _RefusedForm

    def _part_end(self) -> None:
        if self._data is not None:
            try:
                self.value = self._data.decode()
            except UnicodeDecodeError:
                self.value = self._data.decode("latin-1")
