"""Translation between Anthropic's Messages API and the chat API: content blocks to
OpenAI-shaped messages, tools and tool choices to chat keywords, an assistant prefill to a
prompt, and results to Anthropic's message and stream events."""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from llamacrab import Chunks, Image
from llamacrab._llama import Llama
from llamacrab._types import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    FinishReason,
    ToolCall,
    Usage,
)
from llamacrab.server import _wire as wire
from llamacrab.server._anthropic_schemas import (
    ContentBlock,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    MessageIn,
    MessagesRequest,
    OtherBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoiceIn,
    ToolIn,
    ToolResultBlock,
    ToolUseBlock,
)
from llamacrab.server._errors import ApiError, anthropic_body
from llamacrab.server._partial_json import partial_object
from llamacrab.server._schemas import GenerationFields
from llamacrab.server._settings import ServerSettings
from llamacrab.server._sse import sse_json

_STOP_REASONS = {"eos": "end_turn", "length": "max_tokens", "stop": "stop_sequence",
                 "tool_calls": "tool_use"}  # fmt: skip
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _unsupported(what: str) -> ApiError:
    return ApiError(400, f"{what} is not supported by this server")


# -- requests ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    """The turns as the chat API takes them, and the text of a last assistant turn, which
    the answer continues (a prefill) instead of starting a new turn."""

    messages: list[dict[str, Any]]
    prefill: str | None


def conversation(body: CountTokensRequest) -> Conversation:
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else _joined(body.system, "\n")
        messages.append({"role": "system", "content": system})
    turns = _merged(body.messages)
    prefill = _joined(_prefill_blocks(turns.pop()[1])) if turns[-1][0] == "assistant" else None
    if prefill is not None and not any(role == "user" for role, _ in turns):
        # Nothing left to answer: the chat API said "a chat needs at least one message".
        raise ApiError(
            400,
            "messages need a user message: a last assistant message is continued (a prefill) "
            "and only assistant messages were given",
        )
    for role, blocks in turns:
        if role == "system":
            messages.append({"role": "system", "content": _system_text(blocks)})
        elif role == "user":
            messages.extend(_user_messages(blocks))
        else:
            messages.append(_assistant_message(blocks))
    return Conversation(messages, prefill or None)  # an empty prefill starts a turn as usual


def _system_text(blocks: Sequence[ContentBlock]) -> str:
    if any(not isinstance(b, TextBlock) for b in blocks):
        raise ApiError(400, "a system message holds text blocks only")
    return _joined(blocks, "\n")


def _merged(messages: Sequence[MessageIn]) -> list[tuple[str, list[ContentBlock]]]:
    """Consecutive turns of one role as one turn, as Anthropic combines them."""
    turns: list[tuple[str, list[ContentBlock]]] = []
    for message in messages:
        content = message.content
        blocks = [TextBlock(type="text", text=content)] if isinstance(content, str) else content
        if turns and turns[-1][0] == message.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((message.role, list(blocks)))
    return turns


def _joined(blocks: Sequence[ContentBlock], separator: str = "") -> str:
    return separator.join(b.text for b in blocks if isinstance(b, TextBlock))


def _prefill_blocks(blocks: list[ContentBlock]) -> list[ContentBlock]:
    kept: list[ContentBlock] = [b for b in blocks if not isinstance(b, ThinkingBlock)]
    if any(not isinstance(b, TextBlock) for b in kept):
        raise ApiError(
            400,
            "a last assistant message is continued (a prefill) and may hold text only; a "
            "tool_use needs a user turn with its tool_result after it",
        )
    return kept


def _user_messages(blocks: Sequence[ContentBlock]) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages (they come first), then the rest."""
    results = [b for b in blocks if isinstance(b, ToolResultBlock)]
    parts = [_part(b, "user") for b in blocks if not isinstance(b, ToolResultBlock)]
    messages = [{"role": "tool", "tool_call_id": r.tool_use_id, "content": _result(r)}
                for r in results]  # fmt: skip
    if parts:
        messages.append({"role": "user", "content": parts})
    return messages


def _result(block: ToolResultBlock) -> str | list[dict[str, Any]]:
    content = block.content
    if isinstance(content, str):
        return "Error: " + content if block.is_error else content
    parts = [_part(b, "tool_result") for b in content]
    # A chat template has no place for the error flag: the model reads it in the text.
    return [{"type": "text", "text": "Error: "}, *parts] if block.is_error else parts


def _assistant_message(blocks: Sequence[ContentBlock]) -> dict[str, Any]:
    calls = [
        {"id": b.id, "type": "function",
         "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
        for b in blocks if isinstance(b, ToolUseBlock)
    ]  # fmt: skip
    for block in blocks:  # thinking of earlier turns is dropped, as Anthropic drops it
        if not isinstance(block, (TextBlock, ToolUseBlock, ThinkingBlock)):
            raise _refused_block(block, "assistant")
    if not calls:
        return {"role": "assistant", "content": _joined(blocks)}
    return {"role": "assistant", "content": _joined(blocks) or None, "tool_calls": calls}


def _part(block: ContentBlock, where: str) -> dict[str, Any]:
    """A text, plain-text document or image block as an OpenAI content part."""
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    if isinstance(block, DocumentBlock):
        document = block.source
        if document.type != "text" or document.data is None:
            raise _unsupported(f"a document source of type {document.type!r} (send text)")
        # The model reads a plain-text document as text, its title and context first.
        text = "\n\n".join(t for t in (block.title, block.context, document.data) if t)
        return {"type": "text", "text": text}
    if isinstance(block, ImageBlock):
        source = block.source
        if source.type != "base64" or not source.data:
            raise _unsupported(f"an image source of type {source.type!r} (send base64 data)")
        url = f"data:{source.media_type or 'image/png'};base64,{source.data}"
        return {"type": "image_url", "image_url": {"url": url}}
    raise _refused_block(block, where)


def _refused_block(block: ContentBlock, where: str) -> ApiError:
    if isinstance(block, OtherBlock):
        return _unsupported(f"a content block of type {block.type!r}")
    return ApiError(400, f"{block.type} blocks cannot be part of {where} messages")


def chat_options(body: CountTokensRequest, prefill: bool) -> dict[str, Any]:
    """The chat API's tools, tool_choice and response_format; what changes the answer's
    meaning and is not served here is refused."""
    if body.thinking is not None and body.thinking.type != "disabled":
        raise _unsupported(f"thinking of type {body.thinking.type!r} (extended thinking)")
    options: dict[str, Any] = {}
    if body.tools:
        options["tools"] = [_tool(tool) for tool in body.tools]
    if body.tool_choice is not None:
        options["tool_choice"] = _tool_choice(body.tool_choice)
    output = body.output_config.format if body.output_config else None
    if output is not None:
        options["response_format"] = {"type": "json_schema",
                                      "json_schema": {"schema": output.schema_}}  # fmt: skip
    calls_tools = "tools" in options and options.get("tool_choice") != "none"
    if prefill and (calls_tools or output is not None):
        # A prefill is continued as plain text, outside the chat API's tool calls and formats.
        raise _unsupported("an assistant prefill with tools (unless tool_choice is none) or "
                           "with output_config.format")  # fmt: skip
    return options


def _tool(tool: ToolIn) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise _unsupported(f"the server tool {tool.name!r} of type {tool.type!r}")
    if tool.defer_loading:
        raise _unsupported(f"defer_loading (tool {tool.name!r})")
    if tool.input_schema is None:
        raise ApiError(400, f"tool {tool.name!r} needs an input_schema")
    if tool.input_schema.get("type", "object") != "object":  # a tool's input is an object
        raise ApiError(400, f"tool {tool.name!r}: input_schema must be of type 'object', not "
                       f"{tool.input_schema['type']!r}")  # fmt: skip
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoiceIn) -> str | dict[str, Any]:
    if choice.type != "tool":
        return _TOOL_CHOICES[choice.type]
    if not choice.name:
        raise ApiError(400, 'tool_choice {"type": "tool"} needs the name of a tool')
    return {"type": "function", "function": {"name": choice.name}}


def generation_kwargs(body: MessagesRequest, settings: ServerSettings) -> dict[str, Any]:
    """Sampling, stop strings and max_tokens under the server's limits: the same checks as
    the OpenAI routes, through their fields."""
    if body.thread is not None:
        # The anthropic SDK's tool runner asks for a thread first and, told so in these
        # details, sends the whole conversation again without one.
        raise ApiError(400, "thread: this server keeps no threads; send the whole "
                       "conversation in messages", param="thread",
                       details={"error_code": "thread_unsupported_request",
                                "unsupported": ["thread"]})  # fmt: skip
    fields = GenerationFields.model_validate(
        body.model_dump(include={"max_tokens", "temperature", "top_p", "top_k", "stream"})
        | {"stop": body.stop_sequences}
    )
    return wire.generation_kwargs(fields, settings)


def prompt(
    llama: Llama,
    chat: Conversation,
    tools: list[dict[str, Any]] | None,
    max_media: int,
) -> list[int] | Chunks:
    """The prompt the chat API would build, then the prefill. No chat template leaves the last
    turn open, so the turns before it are rendered with the generation prompt and the prefill
    text follows."""
    messages, images = _with_markers(chat.messages, llama, max_media)
    text = llama.chat_prompt(messages, tools=tools) + (chat.prefill or "")
    bos = llama.vocab.bos
    # As the chat API does: a template that writes BOS itself gets no second one.
    add_bos = bos is None or not text.startswith(llama.vocab.token_to_piece(bos, True))
    if images:
        return llama.tokenize_media(text, images, add_special=add_bos, parse_special=True)
    return llama.tokenize(text, add_special=add_bos, parse_special=True)


def prompt_length(tokens: list[int] | Chunks) -> int:
    # Positions, as a generation's usage counts them.
    return tokens.n_pos if isinstance(tokens, Chunks) else len(tokens)


def _with_markers(
    messages: list[dict[str, Any]], llama: Llama, max_media: int
) -> tuple[list[dict[str, Any]], list[Image]]:
    """The messages with each image part turned into the media marker, and the images."""
    images: list[Image] = []
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [_marker(part, llama, images) for part in content]
        out.append({**message, "content": content})
    if len(images) > max_media:
        raise ApiError(400, f"more than {max_media} images in one request")
    return out, images


def _marker(part: dict[str, Any], llama: Llama, images: list[Image]) -> dict[str, Any]:
    if part["type"] != "image_url":
        return part
    try:
        data = base64.b64decode(part["image_url"]["url"].partition(",")[2], validate=True)
    except binascii.Error:
        raise ApiError(400, "an image's base64 data does not decode") from None
    images.append(Image(data=data))
    return {"type": "text", "text": llama.media_marker}


# -- answers -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What shapes an answer besides the model's output."""

    model: str
    one_call: bool  # tool_choice's disable_parallel_tool_use
    max_tokens: int  # the request's, cut to the server's limit

    @classmethod
    def of(cls, body: MessagesRequest, model: str, max_tokens: int) -> Reply:
        one = body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use
        return cls(model, one, max_tokens)

    def stop(self, finish: FinishReason, matched: str | None, generated: int) -> dict[str, Any]:
        """The stop reason, and the stop sequence that ended the answer (``matched``, as
        the engine reports it). Cut short before ``max_tokens`` (``generated`` tokens), the
        context was full: a client told "max_tokens" would ask again with a larger budget."""
        reason = _STOP_REASONS[finish]
        if finish == "length" and generated < self.max_tokens:
            reason = "model_context_window_exceeded"
        return {"stop_reason": reason, "stop_sequence": matched if finish == "stop" else None}

    def calls(self, calls: Sequence[ToolCall], finish: FinishReason | None) -> Sequence[ToolCall]:
        """The calls to answer as tool_use blocks. One cut at max_tokens holds the members of
        its input complete by then, as Anthropic's SDK reads them from a stream (a client
        sees stop_reason max_tokens); one whose input began no object is left out."""
        if finish == "length":
            calls = [call for call in calls if _input(call, cut=True) is not None]
        return calls[:1] if self.one_call else calls


def message_id(result_id: str) -> str:
    return "msg_" + result_id.partition("-")[2]


def usage(value: Usage) -> dict[str, int]:
    return {"input_tokens": value.prompt_tokens - value.cached_tokens,
            "output_tokens": value.completion_tokens,
            "cache_read_input_tokens": value.cached_tokens}  # fmt: skip


def _loaded(arguments: str) -> Any:
    try:
        return json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return None


def _input(call: ToolCall, cut: bool) -> dict[str, Any] | None:
    """A call's arguments as a tool_use block's input; where ``cut`` (at max_tokens), what of
    them is complete."""
    arguments = _loaded(call.arguments)
    if isinstance(arguments, dict):
        return arguments
    return partial_object(call.arguments) if cut else None


def _tool_use(call: ToolCall, cut: bool) -> dict[str, Any]:
    arguments = _input(call, cut)
    if arguments is None:
        raise ApiError(500, f"the model called {call.name!r} with arguments that are not a JSON "
                       f"object: {call.arguments[:200]!r}")  # fmt: skip
    call_id = call.id.removeprefix("call_") or uuid.uuid4().hex[:24]
    return {"type": "tool_use", "id": "toolu_" + call_id, "name": call.name, "input": arguments}


def message(result: ChatCompletion | Completion, reply: Reply) -> dict[str, Any]:
    """A whole answer as Anthropic's message."""
    choice = result.choices[0]
    if isinstance(choice, ChatChoice):
        text, calls = choice.message.content or "", choice.message.tool_calls
    else:
        text, calls = choice.text, ()
    content = [{"type": "text", "text": text}] if text else []
    cut = choice.finish_reason == "length"
    content += [_tool_use(call, cut) for call in reply.calls(calls, choice.finish_reason)]
    return {"id": message_id(result.id), "type": "message", "role": "assistant",
            "content": content, "model": reply.model,
            **reply.stop(choice.finish_reason, choice.stop_sequence,
                         result.usage.completion_tokens),
            "usage": usage(result.usage)}  # fmt: skip


def sse(name: str, payload: dict[str, Any]) -> str:
    """One server-sent event as Anthropic writes them: its type named twice."""
    return f"event: {name}\ndata: {sse_json({'type': name, **payload})}\n\n"


def error_event(error: ApiError) -> str:
    return sse("error", {"error": anthropic_body(error)["error"]})


class MessageEvents:
    """Anthropic's stream events for one answer: ``message_start``, a text block opened by the
    first text, a ``tool_use`` block per call at the end (its input as one JSON delta), then
    ``message_delta`` (stop reason, usage) and ``message_stop``."""

    def __init__(self, reply: Reply, message_id: str, input_tokens: int, cached: int) -> None:
        self.reply, self.id = reply, message_id
        self.input_tokens, self.cached = input_tokens, cached  # the prompt, and what was reused
        self.blocks = 0  # blocks opened so far
        self.text_open = False

    def start(self) -> Iterator[str]:
        usage = {"input_tokens": self.input_tokens - self.cached, "output_tokens": 0,
                 "cache_read_input_tokens": self.cached}  # fmt: skip
        opened: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant", "content": [],
            "model": self.reply.model, "stop_reason": None, "stop_sequence": None, "usage": usage,
        }  # fmt: skip
        yield sse("message_start", {"message": opened})
        yield sse("ping", {})

    def chunk(self, chunk: ChatCompletionChunk | CompletionChunk) -> Iterator[str]:
        if isinstance(chunk, ChatCompletionChunk):
            text, calls = chunk.delta.content, chunk.delta.tool_calls
        else:
            text, calls = chunk.text, ()
        if text:
            if not self.text_open:
                yield from self._open({"type": "text", "text": ""})
                self.text_open = True
            delta = {"type": "text_delta", "text": text}
            yield sse("content_block_delta", {"index": self.blocks - 1, "delta": delta})
        if chunk.finish_reason is not None:
            yield from self._finish(self.reply.calls(calls, chunk.finish_reason), chunk)

    def _open(self, block: dict[str, Any]) -> Iterator[str]:
        yield from self._close_text()
        yield sse("content_block_start", {"index": self.blocks, "content_block": block})
        self.blocks += 1

    def _close_text(self) -> Iterator[str]:
        if self.text_open:
            yield sse("content_block_stop", {"index": self.blocks - 1})
            self.text_open = False

    def _finish(
        self, calls: Sequence[ToolCall], last: ChatCompletionChunk | CompletionChunk
    ) -> Iterator[str]:
        assert last.finish_reason is not None
        for call in calls:
            block = _tool_use(call, cut=last.finish_reason == "length")
            yield from self._open({**block, "input": {}})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            yield sse("content_block_delta", {"index": self.blocks - 1, "delta": delta})
            yield sse("content_block_stop", {"index": self.blocks - 1})
        yield from self._close_text()
        generated = last.usage or Usage(self.input_tokens, 0)
        counts = usage(generated)
        delta = self.reply.stop(last.finish_reason, last.stop_sequence, generated.completion_tokens)
        yield sse("message_delta", {"delta": delta, "usage": counts})
        yield sse("message_stop", {})
