"""llama.cpp's built-in chat formats (``llama_chat_builtin_templates``,
``llama_chat_apply_template``): plain functions, no handle."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llamacrab._exceptions import TemplateError
from llamacrab._native.call import c_string, call, ffi


def llama_cpp_format_names() -> list[str]:
    """The names of the formats llama.cpp knows, sorted."""
    count = call("llama_chat_builtin_templates", ffi.NULL, 0)
    names = ffi.new("const char *[]", count)
    call("llama_chat_builtin_templates", names, count)
    return sorted(ffi.string(n).decode() for n in names)


def apply_llama_cpp_format(
    name: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool
) -> str:
    """Render ``messages`` (role and text content) in llama.cpp's format ``name``."""
    # C strings for every role and content, alive until the call returns.
    keep = [
        (
            ffi.new("char[]", c_string(str(m["role"]), "role")),
            ffi.new("char[]", c_string(str(m.get("content") or ""), "content")),
        )
        for m in messages
    ]
    chat = ffi.new("struct llama_chat_message[]", max(1, len(keep)))
    for entry, (role, content) in zip(chat, keep, strict=False):
        entry.role, entry.content = role, content
    template = c_string(name, "template name")
    size = 4096 + sum(len(ffi.string(c)) for _, c in keep) * 2
    while True:
        buffer = ffi.new("char[]", size)
        n = call("llama_chat_apply_template", template, chat, len(keep), add_generation_prompt,
                 buffer, size)  # fmt: skip
        if n < 0:
            raise TemplateError(f"llama.cpp could not apply the {name!r} chat format")
        if n < size:
            return bytes(ffi.buffer(buffer, n)).decode("utf-8", "replace")
        size = n + 1
