"""A stored response's input items (``GET /v1/responses/{id}/input_items``): ids given when
the response is stored, the items in the shapes of OpenAI's ``ResponseItem`` union, and their
cursor pages."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

from llamacrab.server._errors import ApiError
from llamacrab.server._responses_schemas import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    ImagePart,
    InputItem,
    MessageItem,
    RefusalPart,
    TextPart,
    Unsupported,
)
from llamacrab.server._responses_wire import new_id, output_text, part_text

Order = Literal["asc", "desc"]
KnownItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
# Prefixes of the ids items are given (OpenAI gives messages msg_ and function calls fc_ ids).
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
# include values that cannot change the items listed here: they add to item types never stored
# here, or (image URLs) what is always listed. "message.output_text.logprobs" would add what
# no stored answer kept, so it is refused, as are names OpenAI does not define.
_HARMLESS_INCLUDES = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content", "message.input_image.image_url",
})  # fmt: skip


def with_ids(items: Iterable[InputItem]) -> tuple[InputItem, ...]:
    """``items``, each with an id unique among them: its own (the client's, or one given
    before), else a new one. Items that have one are kept as they are, not copied."""
    taken: set[str] = set()
    identified: list[InputItem] = []
    for item in map(_known, items):
        item_id = item.id
        if item_id is None or item_id in taken:  # a repeated id would make ``after`` ambiguous
            item_id = new_id(_ID_PREFIXES[item.type])
            item = item.model_copy(update={"id": item_id})
        taken.add(item_id)
        identified.append(item)
    return tuple(identified)


def check_includes(names: Iterable[str]) -> None:
    for name in names:
        if name not in _HARMLESS_INCLUDES:
            raise ApiError(400, f"include {_shown(name)} is not supported when listing input "
                           "items", param="include", code="unsupported_parameter")  # fmt: skip


def page(items: Sequence[InputItem], order: Order, limit: int, after: str | None) -> dict[str, Any]:
    """The ``limit`` items after the one whose id is ``after`` (else from the first) in
    ``order``: ``asc`` as the conversation went, ``desc`` (OpenAI's default) the newest first."""
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0 if after is None else _position(ordered, after) + 1
    data = [listed(item) for item in ordered[start : start + limit]]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + limit < len(ordered)}  # fmt: skip


def _position(items: Sequence[InputItem], item_id: str) -> int:
    for position, item in enumerate(items):
        if _known(item).id == item_id:
            return position
    raise ApiError(400, f"no input item {_shown(item_id)} in this response: after takes the id "
                   "of an item it lists", param="after")  # fmt: skip


def listed(item: InputItem) -> dict[str, Any]:
    """``item`` as OpenAI lists it: a message of the user, system or developer as a
    ``ResponseInputMessageItem``, one of the assistant as a ``ResponseOutputMessage``, calls and
    their outputs as ``ResponseFunctionToolCallItem`` and ``ResponseFunctionToolCallOutputItem``;
    content in parts, and every status given ("completed" where the client sent none)."""
    known = _known(item)
    common = {"id": known.id, "type": known.type, "status": known.status or "completed"}
    if isinstance(known, MessageItem):
        return {**common, "role": known.role, "content": _content(known)}
    if isinstance(known, FunctionCallItem):
        return {**common, "call_id": known.call_id, "name": known.name,
                "arguments": known.arguments}  # fmt: skip
    output = known.output
    parts = output if isinstance(output, str) else list(map(_input_part, output))
    return {**common, "call_id": known.call_id, "output": parts}


def _known(item: InputItem) -> KnownItem:
    if isinstance(item, Unsupported):  # refused by check_supported: never stored
        raise TypeError(f"an item of type {item.type!r} cannot be stored")
    return item


def _content(message: MessageItem) -> list[dict[str, Any]]:
    content = message.content
    parts = [TextPart(type="input_text", text=content)] if isinstance(content, str) else content
    if message.role != "assistant":
        return list(map(_input_part, parts))
    # An output message holds text and refusals only (OpenAI refuses images there).
    return [_output_part(part) for part in parts if not isinstance(part, ImagePart)]


def _input_part(part: ContentPart) -> dict[str, Any]:
    if isinstance(part, ImagePart):
        return {"type": "input_image", "image_url": part.image_url, "file_id": part.file_id,
                "detail": part.detail or "auto"}  # fmt: skip
    return {"type": "input_text", "text": part_text(part)}


def _output_part(part: ContentPart) -> dict[str, Any]:
    if isinstance(part, RefusalPart):
        return {"type": "refusal", "refusal": part.refusal}
    return output_text(part_text(part))


def _shown(text: str) -> str:
    """``text`` quoted, cut short: a client's 100,000-character id is not echoed whole."""
    return repr(text) if len(text) <= 80 else repr(text[:77] + "...")
