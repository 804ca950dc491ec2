"""The Responses API's streamed events, made from chat chunks: the response's lifecycle
(created, in progress, then completed, incomplete or failed), a message item whose text grows
by deltas, then one item per function call. Each event has its ``sequence_number``."""

from __future__ import annotations

from typing import Any

from llamacrab._types import ChatCompletionChunk, ToolCall
from llamacrab.server._errors import ApiError
from llamacrab.server._responses_wire import (
    Draft,
    call_item,
    message_item,
    new_id,
    output_text,
    status,
    usage,
)
from llamacrab.server._sse import sse_json
from llamacrab.server._wire import kept_calls

Event = dict[str, Any]


def frame(event: Event) -> str:
    """One server-sent event, named by its type as OpenAI names them."""
    return f"event: {event['type']}\ndata: {sse_json(event)}\n\n"


class ResponseEvents:
    """The events of one streamed response, in order. The message item opens with the first
    text (a function call the model makes is held back by the chat stream and arrives whole
    with the last chunk); ``final`` is the finished response object."""

    def __init__(self, draft: Draft, parallel_tool_calls: bool) -> None:
        self.draft = draft
        self.parallel = parallel_tool_calls
        self.output: list[dict[str, Any]] = []  # finished items
        self.final: dict[str, Any] | None = None
        self._sequence = 0
        self._message: str | None = None  # the open message item's id
        self._text: list[str] = []

    def start(self) -> list[Event]:
        response = self.draft.object("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]  # fmt: skip

    def chunk(self, chunk: ChatCompletionChunk) -> list[Event]:
        events = []
        if chunk.delta.content:
            events += self._open_message()
            self._text.append(chunk.delta.content)
            events.append(self._event("response.output_text.delta", **self._at_text(),
                                      delta=chunk.delta.content, logprobs=[]))  # fmt: skip
        if chunk.finish_reason is not None:
            events += self._finish(chunk)
        return events

    def failed(self, error: ApiError) -> list[Event]:
        """An error after the answer began: the open message closed as incomplete (the SDK
        takes the failed response's output as it is: the text streamed so far would vanish),
        the error, then the response as failed."""
        closed = self._close_message("incomplete") if self._message is not None else []
        failure = {"code": "server_error", "message": error.message}
        response = self.draft.object("failed", self.output, error=failure)
        return [*closed,
                self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=response)]  # fmt: skip

    def _finish(self, chunk: ChatCompletionChunk) -> list[Event]:
        state = status(chunk.finish_reason)
        calls = kept_calls(chunk.delta.tool_calls, self.parallel)
        events = [] if calls or self._message else self._open_message()  # an empty answer
        if self._message is not None:
            events += self._close_message(state)
        for call in calls:
            events += self._call(call, state)
        totals = usage(chunk.usage) if chunk.usage is not None else None
        self.final = self.draft.object(state, self.output, totals)
        kind = "response.completed" if state == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self.final)]

    def _open_message(self) -> list[Event]:
        if self._message is not None:
            return []
        self._message = new_id("msg")
        item = message_item(self._message, None, "in_progress")
        return [self._event("response.output_item.added", output_index=len(self.output), item=item),
                self._event("response.content_part.added", **self._at_text(),
                            part=output_text(""))]  # fmt: skip

    def _close_message(self, state: str) -> list[Event]:
        assert self._message is not None
        text = "".join(self._text)
        item = message_item(self._message, text, state)
        where = self._at_text()
        self._message = None
        self.output.append(item)
        return [self._event("response.output_text.done", **where, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, part=output_text(text)),
                self._event("response.output_item.done", output_index=where["output_index"],
                            item=item)]  # fmt: skip

    def _call(self, call: ToolCall, state: str) -> list[Event]:
        """A call arrives whole: its arguments are one delta (cut at max_output_tokens, the
        text so far, and the item is incomplete)."""
        item_id, index = new_id("fc"), len(self.output)
        where = {"item_id": item_id, "output_index": index}
        item = call_item(item_id, call, state)
        self.output.append(item)
        started = call_item(item_id, call, "in_progress", arguments="")
        return [
            self._event("response.output_item.added", output_index=index, item=started),
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event("response.function_call_arguments.done", **where, name=call.name,
                        arguments=call.arguments),
            self._event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    def _at_text(self) -> dict[str, Any]:
        return {"item_id": self._message, "output_index": len(self.output), "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event
