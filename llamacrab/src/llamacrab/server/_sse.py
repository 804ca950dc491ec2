"""The JSON of one server-sent event's ``data:`` line."""

from __future__ import annotations

import json

# JSON may carry these raw, and SSE only breaks lines at CR and LF, but clients that split a
# stream with Python's str.splitlines (httpx's aiter_lines among them) also break at these and
# receive half an event; escaped, the text decodes to the same string.
_SPLITLINES_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def sse_json(payload: object) -> str:
    text = json.dumps(payload, ensure_ascii=False)
    for raw, escaped in _SPLITLINES_BREAKS.items():
        if raw in text:
            text = text.replace(raw, escaped)
    return text
