"""Translation for the Responses API: a request's items into chat messages and a chat request
(so the chat route's limits and engine apply), and a chat result into a response object."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from llamacrab._types import ChatCompletion, ToolCall, Usage
from llamacrab.server._errors import ApiError
from llamacrab.server._responses_schemas import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    ImagePart,
    InputItem,
    MessageItem,
    RefusalPart,
    ResponseRequest,
    TextPart,
    Unsupported,
)
from llamacrab.server._schemas import ChatCompletionRequest
from llamacrab.server._wire import kept_calls

# Opaque data the client may ask back; none is ever produced here, so asking for it is harmless.
_INCLUDABLE = ("reasoning.encrypted_content",)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- refusals ------------------------------------------------------------------------------------


def check_supported(body: ResponseRequest, items: Sequence[InputItem]) -> None:
    """400 naming the first field this server cannot honour, rather than an answer that
    silently ignores it (``items``: the request's input, references resolved)."""
    for param, message in _unsupported(body, items):
        raise ApiError(400, message, param=param, code="unsupported_parameter")


def _unsupported(body: ResponseRequest, items: Sequence[InputItem]) -> Iterator[tuple[str, str]]:
    if body.background:
        yield "background", "background responses are not supported; send background: false"
    if body.conversation is not None:
        yield "conversation", ("conversations are not supported: send the history as input "
                               "items, or continue with previous_response_id")  # fmt: skip
    if body.prompt is not None:
        yield "prompt", "stored prompt templates are not supported: send instructions and input"
    if body.context_management:
        yield "context_management", "context management (compaction) is not supported"
    if body.moderation is not None:
        yield "moderation", "moderation is not supported"
    if body.top_logprobs:
        yield (
            "top_logprobs",
            "log-probabilities are not supported here; /v1/chat/completions has them",
        )
    if body.truncation == "auto":
        yield "truncation", ('truncation "auto" is not supported: input longer than the context '
                             "is refused")  # fmt: skip
    for name in body.include or ():
        if name not in _INCLUDABLE:
            yield "include", f"include {name!r} is not supported"
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        yield "text.verbosity", f"text.verbosity {body.text.verbosity!r} is not supported"
    for i, tool in enumerate(body.tools or ()):
        if isinstance(tool, Unsupported):
            yield "tools", (f"tools[{i}]: tool type {tool.type!r} is not supported; this server "
                            "calls function tools only")  # fmt: skip
    if isinstance(body.tool_choice, Unsupported):
        yield "tool_choice", (f"tool_choice type {body.tool_choice.type!r} is not supported; "
                              'use "none", "auto", "required" or a function')  # fmt: skip
    for i, item in enumerate(items):
        yield from _unsupported_in_item(item, f"input[{i}]")


def _unsupported_in_item(item: InputItem, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(item, Unsupported):
        yield "input", (f"{where}: item type {item.type!r} is not supported; send message, "
                        "function_call, function_call_output and item_reference "
                        "items")  # fmt: skip
        return
    if isinstance(item, FunctionCallItem):
        return
    field, parts = (
        ("content", item.content) if isinstance(item, MessageItem) else ("output", item.output)
    )
    for j, part in enumerate([] if isinstance(parts, str) else parts):
        at = f"{where}.{field}[{j}]"
        if isinstance(part, Unsupported):
            yield "input", (f"{at}: content type {part.type!r} is not supported; send "
                            "input_text, output_text or input_image")  # fmt: skip
        elif isinstance(part, ImagePart) and field == "output":
            yield "input", f"{at}: images in a function's output are not supported"
        elif isinstance(part, ImagePart) and not part.image_url:
            yield "input", f"{at}: send images as image_url (file_id is not supported)"


# -- request -------------------------------------------------------------------------------------


def chat_messages(instructions: str | None, items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """OpenAI chat messages for the conversation (items checked by ``check_supported``):
    the instructions as the system message, consecutive function calls as one assistant
    message's tool_calls, their outputs as tool messages."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    names: dict[str, str] = {}  # call_id -> function: templates may show it with the result
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _chat_content(item.content)})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            _add_call(messages, item)
        elif isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "tool_call_id": item.call_id,
                       "content": _chat_content(item.output)}  # fmt: skip
            if item.call_id in names:
                message["name"] = names[item.call_id]
            messages.append(message)
    return messages


def _chat_content(content: str | list[ContentPart]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not any(isinstance(part, ImagePart) for part in content):
        return "".join(part_text(part) for part in content)
    return [
        {"type": "image_url", "image_url": {"url": part.image_url}}
        if isinstance(part, ImagePart)
        else {"type": "text", "text": part_text(part)}
        for part in content
    ]


def part_text(part: ContentPart) -> str:
    if isinstance(part, TextPart):
        return part.text
    return part.refusal if isinstance(part, RefusalPart) else ""


def _add_call(messages: list[dict[str, Any]], item: FunctionCallItem) -> None:
    """The call joins the assistant message just before it (its text or earlier calls)."""
    call = {"id": item.call_id, "type": "function",
            "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def chat_request(body: ResponseRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request this response is generated as."""
    if not messages:
        raise ApiError(400, "there is nothing to answer: send input", param="input")
    # strict needs nothing more: a forced call's arguments follow the schema by grammar.
    function = {"type", "strict"}
    tools = [{"type": "function", "function": t.model_dump(exclude=function, exclude_none=True)}
             for t in body.tools or ()]  # fmt: skip
    return ChatCompletionRequest.model_validate({
        "model": body.model, "messages": messages, "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "tools": tools or None, "tool_choice": _chat_tool_choice(body),
        "response_format": _response_format(body),
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
    })  # fmt: skip


def _chat_tool_choice(body: ResponseRequest) -> str | dict[str, Any] | None:
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice if isinstance(choice, str) else None


def _response_format(body: ResponseRequest) -> dict[str, Any] | None:
    spec = body.text.format if body.text is not None else None
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        return {"type": "json_object"}
    if spec.schema_ is None:
        raise ApiError(400, "text.format json_schema needs a schema", param="text.format.schema")
    schema = {"name": spec.name, "schema": spec.schema_, "strict": spec.strict}
    return {"type": "json_schema", "json_schema": schema}


# -- response ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Draft:
    """What every state of one response shares: its id, its creation time, and the request's
    settings it reports back."""

    id: str
    created_at: int
    echo: dict[str, Any]

    def object(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": error, "incomplete_details": incomplete,
                "output": output, "usage": usage, **self.echo}  # fmt: skip


def draft(body: ResponseRequest, model: str, stored: bool) -> Draft:
    choice = body.tool_choice
    tool_choice = choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto"
    text = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text else None
    echo = {
        "model": model, "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "max_output_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "tool_choice": tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls, "store": stored,
        "text": {"format": text or {"type": "text"}}, "metadata": body.metadata or {},
        "user": body.user, "background": False, "truncation": "disabled",
        # No reasoning summary is written, whatever was asked.
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                      "summary": None},
    }  # fmt: skip
    return Draft(new_id("resp"), int(time.time()), echo)


def status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(item_id: str, text: str | None, state: str) -> dict[str, Any]:
    """An assistant message; ``text`` None while it has no content part yet."""
    parts = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id, "status": state, "role": "assistant",
            "content": parts}  # fmt: skip


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(
    item_id: str, call: ToolCall, state: str, arguments: str | None = None
) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments,
            "status": state}  # fmt: skip


def usage(value: Usage) -> dict[str, Any]:
    return {"input_tokens": value.prompt_tokens,
            # OpenAI counts tokens written to a cache with a retention it bills; a prompt
            # stays in memory here without such a write.
            "input_tokens_details": {"cached_tokens": value.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": value.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": value.total_tokens}  # fmt: skip


def response(draft: Draft, result: ChatCompletion, parallel: bool) -> dict[str, Any]:
    """The response object for a whole chat result: its text as a message item (also when
    empty, unless the model only called functions), then its function calls."""
    choice = result.choices[0]
    state = status(choice.finish_reason)
    calls = kept_calls(choice.message.tool_calls, parallel)
    output = []
    if choice.message.content or not calls:
        output.append(message_item(new_id("msg"), choice.message.content or "", state))
    output.extend(call_item(new_id("fc"), call, state) for call in calls)  # cut: incomplete
    return draft.object(state, output, usage(result.usage))
