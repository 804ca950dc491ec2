"""What a chat request adds to a completion: response_format and tool_choice grammars, and
tool calls found in (or checked in) the answer, whole or streamed."""

from __future__ import annotations

import json
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llamacrab._chat.generic_tools import (
    GenericSplitter,
    forced_tool_name,
    generic_grammar,
    parse_generic,
)
from llamacrab._chat.prompt import template_kwargs
from llamacrab._chat.tool_calls import (
    ToolCallSplitter,
    check_arguments,
    forced_call_grammar,
    lazy_call_grammar,
    parse_tool_calls,
    tool_names,
)
from llamacrab._engine.stream import Stream
from llamacrab._exceptions import InvalidParameterError
from llamacrab._field_types import check_field_types
from llamacrab._grammar.json_schema import JSON_OBJECT_GRAMMAR, schema_to_grammar
from llamacrab._types import (
    ChatChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessage,
    CompletionChoice,
    CompletionChunk,
    FinishReason,
    Logprobs,
    ToolCall,
)


@dataclass
class ChatOptions:
    """The chat-only options of one request (validated when created). ``generic_tools`` is
    set when the prompt is built: the template cannot present the tools, so they are
    presented, constrained and parsed in llama.cpp's generic format. ``prefill_assistant``:
    a last assistant message is continued (``_chat.prompt.assistant_prefill``).
    ``add_generation_prompt``: the prompt opens the answer's turn (``answer_prompt``'s)."""

    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] = "auto"
    response_format: Mapping[str, Any] | None = None
    check_tool_arguments: bool = False
    # More variables for a Jinja chat template (llama-server's chat_template_kwargs).
    template_kwargs: Mapping[str, Any] | None = None
    prefill_assistant: bool = True
    add_generation_prompt: bool = True
    generic_tools: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        check_field_types(self)
        self.template_kwargs = template_kwargs(self.template_kwargs)
        if self.tools:
            tool_names(self.tools)  # validates their shape
        elif self.tool_choice not in ("auto", "none"):
            raise InvalidParameterError(f"tool_choice {self.tool_choice!r} needs tools")
        if isinstance(self.tool_choice, Mapping):
            forced_tool_name(self.tool_choice)  # validates its shape

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def check_continuable(self) -> None:
        """A continued assistant message (a prefill) is free text: a response_format, a forced
        tool call or the generic tool format shape the whole answer with a grammar, which
        would have to take the prefill in too (llama-server feeds it to the grammar; llamacrab's
        grammars start with the answer)."""
        shaped = _response_schema(self.response_format) is not None or (
            self.parses_tools and (self.generic_tools or self.tool_choice != "auto")
        )
        if shaped:
            raise InvalidParameterError(
                "the last message is an assistant's, which is continued (a prefill), and a "
                "response_format, a forced tool_choice or tools this chat template cannot "
                "present shape the whole answer: drop the prefill or end with a user message"
            )

    def completion_kwargs(self, kwargs: dict[str, Any], template: str | None) -> dict[str, Any]:
        """Completion keywords plus the grammar the response format or tool choice needs;
        ``template`` is the chat template's source, where tool-call openers are looked up."""
        if self.generic_tools and self.parses_tools:
            return self._generic_kwargs(kwargs)
        kwargs = _with_response_format(self.response_format, kwargs)
        if not self.tools or self.tool_choice == "none":
            return kwargs
        if self.tool_choice == "auto":
            lazy = None if "grammar" in kwargs else lazy_call_grammar(self.tools, template)
            return kwargs if lazy is None else {**kwargs, **lazy}
        if "grammar" in kwargs:
            raise InvalidParameterError(
                "a forced tool_choice and a grammar/response_format conflict"
            )
        if self.tool_choice == "required":
            return {**kwargs, "grammar": forced_call_grammar(self.tools)}
        if isinstance(self.tool_choice, Mapping):
            only = forced_tool_name(self.tool_choice)
            return {**kwargs, "grammar": forced_call_grammar(self.tools, only=only)}
        raise InvalidParameterError(f"unknown tool_choice {self.tool_choice!r}")

    def _generic_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The generic format's grammar: a call, or for "auto" a call or a response (its
        text, or the response_format's JSON). A grammar of the caller's own replaces it for
        "auto" (the answer is parsed all the same); a forced call cannot have one."""
        assert self.tools
        forced = self.tool_choice != "auto"
        if "grammar" in kwargs or (forced and _response_schema(self.response_format)):
            if forced:
                raise InvalidParameterError(
                    "a forced tool_choice and a grammar/response_format conflict"
                )
            return _with_response_format(self.response_format, kwargs)
        response = _response_schema(self.response_format)
        return {**kwargs, "grammar": generic_grammar(self.tools, self.tool_choice, response)}

    def _checked(
        self, calls: Sequence[ToolCall], finish: FinishReason | None
    ) -> tuple[tuple[ToolCall, ...], FinishReason]:
        """The calls, checked, and the finish reason: "tool_calls", or "length" for a call cut
        at max_tokens (as OpenAI: its arguments are the text so far, so not checked)."""
        if finish == "length" and not all(map(_is_json, (c.arguments for c in calls))):
            return tuple(calls), finish
        if self.check_tool_arguments and self.tools:
            check_arguments(calls, self.tools)
        return tuple(calls), "tool_calls"

    def choice(self, choice: CompletionChoice) -> ChatChoice:
        text = choice.text
        if self.parses_tools:
            parse = parse_generic if self.generic_tools else parse_tool_calls
            content, calls = parse(choice.text)
            if calls:
                checked, finish = self._checked(calls, choice.finish_reason)
                message = ChatMessage("assistant", content or None, checked)
                return ChatChoice(choice.index, message, finish, choice.logprobs)
            text = content  # the generic format's response, unwrapped
        message = ChatMessage("assistant", text)
        return ChatChoice(choice.index, message, choice.finish_reason, choice.logprobs,
                          choice.stop_sequence)  # fmt: skip

    def chunks(self, stream: Stream[CompletionChunk]) -> Generator[ChatCompletionChunk, None, None]:
        """Completion chunks as chat deltas; with tools, a call's text is held back and the
        last delta carries the parsed calls."""
        splitter: ToolCallSplitter | GenericSplitter | None = None
        if self.parses_tools:
            splitter = GenericSplitter() if self.generic_tools else ToolCallSplitter()
        first = True
        held: list[Logprobs] = []  # of chunks held back: they go with the next delta sent
        try:
            for chunk in stream:
                text, finish = chunk.text, chunk.finish_reason
                calls: tuple[ToolCall, ...] = ()
                if splitter is not None:
                    text = splitter.push(text)
                    if finish is not None:
                        rest, found = splitter.finish()
                        text += rest
                        if found:
                            calls, finish = self._checked(found, finish)
                if chunk.logprobs is not None:
                    held.append(chunk.logprobs)
                if not (first or text or calls or finish):
                    continue  # held back: part of a tool call, or text a stop may still end
                logprobs = Logprobs.join(held) if held else None
                held = []
                delta = ChatDelta("assistant" if first else None, text, calls)
                first = False
                stop = chunk.stop_sequence if finish == "stop" else None
                yield ChatCompletionChunk("chatcmpl-" + chunk.id.removeprefix("cmpl-"),
                                          chunk.created, chunk.model, chunk.index, delta,
                                          finish, chunk.usage, logprobs, stop,
                                          chunk.usage_so_far)  # fmt: skip
        finally:
            stream.close()  # breaking out of the chat stream stops generation at once


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


def _response_schema(response_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The JSON Schema an OpenAI ``response_format`` asks for (None: free text)."""
    kind = None if response_format is None else response_format.get("type")
    if kind in (None, "text") or response_format is None:
        return None
    if kind == "json_object":
        return dict(response_format.get("schema") or {"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        if "schema" not in spec:
            raise InvalidParameterError('response_format json_schema needs {"schema": {...}}')
        return dict(spec["schema"])
    raise InvalidParameterError(f"unknown response_format type {kind!r}")


def _with_response_format(
    response_format: Mapping[str, Any] | None, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Completion keywords with the grammar an OpenAI ``response_format`` asks for."""
    kind = None if response_format is None else response_format.get("type")
    if kind in (None, "text"):
        return kwargs
    if "grammar" in kwargs:
        raise InvalidParameterError("pass response_format or grammar, not both")
    if kind == "json_object":
        schema = response_format.get("schema") if response_format else None
        grammar = JSON_OBJECT_GRAMMAR if schema is None else schema_to_grammar(schema)
    elif kind == "json_schema" and response_format is not None:
        spec = response_format.get("json_schema") or {}
        if "schema" not in spec:
            raise InvalidParameterError('response_format json_schema needs {"schema": {...}}')
        grammar = schema_to_grammar(spec["schema"])
    else:
        raise InvalidParameterError(f"unknown response_format type {kind!r}")
    return {**kwargs, "grammar": grammar}
