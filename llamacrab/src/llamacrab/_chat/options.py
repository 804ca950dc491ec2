"""What a chat request adds to a completion: response_format and tool_choice grammars, and
tool calls found in (or checked in) the answer, whole or streamed."""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
from llamacrab._grammar.json_schema import JSON_OBJECT_GRAMMAR, schema_to_grammar
from llamacrab._types import (
    ChatChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessage,
    CompletionChoice,
    CompletionChunk,
    ToolCall,
)


@dataclass(frozen=True)
class ChatOptions:
    """The chat-only options of one request (validated when created)."""

    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] = "auto"
    response_format: Mapping[str, Any] | None = None
    check_tool_arguments: bool = False

    def __post_init__(self) -> None:
        if self.tools:
            tool_names(self.tools)  # validates their shape
        elif self.tool_choice not in ("auto", "none"):
            raise InvalidParameterError(f"tool_choice {self.tool_choice!r} needs tools")

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def completion_kwargs(self, kwargs: dict[str, Any], template: str | None) -> dict[str, Any]:
        """Completion keywords plus the grammar the response format or tool choice needs;
        ``template`` is the chat template's source, where tool-call openers are looked up."""
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
            name = (self.tool_choice.get("function") or {}).get("name")
            return {**kwargs, "grammar": forced_call_grammar(self.tools, only=name)}
        raise InvalidParameterError(f"unknown tool_choice {self.tool_choice!r}")

    def _checked(self, calls: Sequence[ToolCall]) -> tuple[ToolCall, ...]:
        if self.check_tool_arguments and self.tools:
            check_arguments(calls, self.tools)
        return tuple(calls)

    def choice(self, choice: CompletionChoice) -> ChatChoice:
        if self.parses_tools:
            content, calls = parse_tool_calls(choice.text)
            if calls:
                message = ChatMessage("assistant", content or None, self._checked(calls))
                return ChatChoice(choice.index, message, "tool_calls", choice.logprobs)
        message = ChatMessage("assistant", choice.text)
        return ChatChoice(choice.index, message, choice.finish_reason, choice.logprobs)

    def chunks(self, stream: Stream[CompletionChunk]) -> Generator[ChatCompletionChunk, None, None]:
        """Completion chunks as chat deltas; with tools, a call's text is held back and the
        last delta carries the parsed calls."""
        splitter = ToolCallSplitter() if self.parses_tools else None
        first = True
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
                            calls, finish = self._checked(found), "tool_calls"
                if not (first or text or calls or finish):
                    continue  # held back: part of a tool call
                delta = ChatDelta("assistant" if first else None, text, calls)
                first = False
                yield ChatCompletionChunk("chatcmpl-" + chunk.id.removeprefix("cmpl-"),
                                          chunk.created, chunk.model, chunk.index, delta,
                                          finish, chunk.usage, chunk.logprobs)  # fmt: skip
        finally:
            stream.close()  # breaking out of the chat stream stops generation at once


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
