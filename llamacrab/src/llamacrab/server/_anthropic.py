"""Anthropic's Messages API (``POST /v1/messages`` and ``/v1/messages/count_tokens``) as a
translation onto the chat API: the same engine, limits, API keys, cancellation and metrics as
the OpenAI routes. Errors on these routes are answered in Anthropic's shape."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from functools import partial
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.requests import Request

from llamacrab import Chunks, Stream
from llamacrab._exceptions import LlamaError
from llamacrab._llama import Llama
from llamacrab.server import _anthropic_wire as wire
from llamacrab.server._anthropic_schemas import (
    CountTokensRequest,
    CountTokensResponse,
    ErrorOut,
    MessageResponse,
    MessagesRequest,
)
from llamacrab.server._errors import (
    ANTHROPIC_PATH,
    ApiError,
    error_response,
    from_llama_error,
    invalid_body,
)
from llamacrab.server._json_body import JsonBodyRoute
from llamacrab.server._lora import request_lora
from llamacrab.server._state import ServerState
from llamacrab.server._streaming import complete, in_thread, sse_events

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorOut} for status in (400, 401, 404, 413, 503, 504)
}


class _AnthropicRoute(JsonBodyRoute):
    """A route whose errors are answered in Anthropic's shape (the app's handlers answer in
    OpenAI's)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except (ApiError, LlamaError, RequestValidationError) as error:
                return error_response(ANTHROPIC_PATH, _api_error(error))

        return answer


def _api_error(error: ApiError | LlamaError | RequestValidationError) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, LlamaError):
        return from_llama_error(error)
    return invalid_body(error.errors())


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    router = APIRouter(route_class=_AnthropicRoute, responses=_ERRORS)
    max_media = state.settings.max_media

    @router.post(ANTHROPIC_PATH, response_model=MessageResponse)
    async def messages(body: MessagesRequest, client: Request) -> Any:
        llama = state.generator(body.model)
        chat = wire.conversation(body)
        options = wire.chat_options(body, prefill=chat.prefill is not None)
        kwargs = wire.generation_kwargs(body, state.settings)
        kwargs.update(request_lora(body.lora, llama))
        reply = wire.Reply.of(body, state.model_name(body.model), kwargs["max_tokens"])
        prompt = await _prefill_prompt(llama, chat, options, max_media)
        stream, create = _generation(llama, chat, prompt, options, kwargs)
        if body.stream:  # a stream opens with the prompt's length
            length = await _input_tokens(llama, chat, prompt, options)
            return await _streamed(state, client, stream, reply, length)
        return wire.message(await complete(state, client, create), reply)

    @router.post(ANTHROPIC_PATH + "/count_tokens", response_model=CountTokensResponse)
    async def count_tokens(body: CountTokensRequest) -> Any:
        llama = state.generator(body.model)
        chat = wire.conversation(body)
        options = wire.chat_options(body, prefill=chat.prefill is not None)
        prompt = await _prefill_prompt(llama, chat, options, max_media)
        return {"input_tokens": await _input_tokens(llama, chat, prompt, options)}

    app.include_router(router)


async def _prefill_prompt(
    llama: Llama, chat: wire.Conversation, options: dict[str, Any], max_media: int
) -> list[int] | Chunks | None:
    """The prompt a prefill is continued from (the completion API's); None without one."""
    if chat.prefill is None:
        return None
    return await in_thread(wire.prompt, llama, chat, options.get("tools"), max_media)  # type: ignore[no-any-return]


async def _input_tokens(
    llama: Llama, chat: wire.Conversation, prompt: list[int] | Chunks | None,
    options: dict[str, Any],
) -> int:  # fmt: skip
    """The prompt's length as the generation will decode it: a prefill's own prompt, else the
    chat API's (which describes tools a template cannot present, and drops them for "none")."""
    if prompt is not None:
        return wire.prompt_length(prompt)
    return int(await in_thread(partial(llama.count_chat_tokens, chat.messages, **options)))


def _generation(
    llama: Llama,
    chat: wire.Conversation,
    prompt: list[int] | Chunks | None,
    options: dict[str, Any],
    kwargs: dict[str, Any],
) -> tuple[Callable[[], Stream[Any]], Callable[..., Any]]:
    """The stream and the whole-answer calls: the chat API, or for a prefill the completion
    API on the prompt that ends with it (tools were presented in it, or refused)."""
    if chat.prefill is None:
        kwargs = {**options, **kwargs}
        return (partial(llama.stream_chat_completion, chat.messages, **kwargs),
                partial(llama.create_chat_completion, chat.messages, **kwargs))  # fmt: skip
    assert prompt is not None
    return (partial(llama.stream_completion, prompt, **kwargs),
            partial(llama.create_completion, prompt, **kwargs))  # fmt: skip


async def _streamed(
    state: ServerState,
    client: Request,
    stream: Callable[[], Stream[Any]],
    reply: wire.Reply,
    input_tokens: int,
) -> StreamingResponse:
    opened = await in_thread(stream)

    async def write(chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
        events: wire.MessageEvents | None = None  # the message's id comes with the first chunk
        try:
            async for chunk in chunks:
                if events is None:  # the prompt is in memory now: how much of it was reused
                    events = wire.MessageEvents(reply, wire.message_id(chunk.id), input_tokens,
                                                opened.session.reused)  # fmt: skip
                    for text in events.start():
                        yield text
                for text in events.chunk(chunk):
                    yield text
        except ApiError as error:
            yield wire.error_event(error)

    return await sse_events(state, client, opened, write)
