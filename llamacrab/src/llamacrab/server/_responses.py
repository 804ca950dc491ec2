"""OpenAI's Responses API (``/v1/responses``) over the chat API: each request is translated
into a chat request, so the chat route's limits, cancellation and metrics apply, and its result
(whole or streamed) translated back. Responses are kept for ``previous_response_id`` in a
bounded in-memory store, which also lists their input items; a request's input tokens are
counted from the same chat request, without generating."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Annotated, Any, NamedTuple

from fastapi import FastAPI, Query
from starlette.requests import Request
from starlette.responses import Response

from llamacrab import Llama
from llamacrab._types import ChatCompletionChunk
from llamacrab.server import _responses_wire as wire
from llamacrab.server._errors import ApiError
from llamacrab.server._lora import request_lora
from llamacrab.server._responses_children import ChildLookups
from llamacrab.server._responses_events import ResponseEvents, frame
from llamacrab.server._responses_items import Order, check_includes, page, with_ids
from llamacrab.server._responses_schemas import (
    INPUT_ITEMS,
    DeletedResponse,
    InputItem,
    InputItemList,
    InputTokens,
    ItemReference,
    RequestItem,
    ResponseObject,
    ResponseRequest,
)
from llamacrab.server._responses_store import ResponseStore
from llamacrab.server._state import ServerState
from llamacrab.server._streaming import ERRORS, complete, in_thread, sse_events
from llamacrab.server._wire import chat_kwargs


class _ChatCall(NamedTuple):
    """The chat call that answers a request: the model, the messages and the keywords (and the
    items of the earlier responses the messages begin with)."""

    llama: Llama
    previous: tuple[InputItem, ...]
    own: tuple[InputItem, ...]  # the request's input, references to stored items resolved
    messages: list[dict[str, Any]]
    kwargs: dict[str, Any]


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    """``POST /v1/responses`` (also ``/responses``), ``GET``/``DELETE`` of a stored one, ``GET``
    of its input items and ``POST`` of its cancel (refused), and ``POST
    /v1/responses/input_tokens``. A stored response's routes name no model: what this store
    lacks, they ask of the isolated models' processes, which keep their own."""
    settings = state.settings
    store = ResponseStore(settings.max_stored_responses, settings.stored_response_ttl,
                          settings.max_stored_response_bytes)  # fmt: skip
    children = ChildLookups(state.registry)

    async def chat_call(body: ResponseRequest) -> _ChatCall:
        """What answers ``body``, once everything it asks for has been checked."""
        llama = state.generator(body.model)
        own = tuple(_referenced(store, item, i) for i, item in enumerate(body.input))
        wire.check_supported(body, own)
        previous = await earlier(body.previous_response_id)
        messages = wire.chat_messages(body.instructions, (*previous, *own))
        kwargs = chat_kwargs(wire.chat_request(body, messages), settings)
        kwargs.update(request_lora(body.lora, llama))
        return _ChatCall(llama, previous, own, messages, kwargs)

    async def earlier(response_id: str | None) -> tuple[InputItem, ...]:
        """The conversation ``response_id`` ended: a 404 where it is not kept here, naming the
        isolated model whose process keeps it (a follow-up there can continue it)."""
        if response_id is None:
            return ()
        stored = store.get(response_id)
        if stored is not None:
            return stored.history
        model = await children.holder(response_id)
        if model is None:
            raise _not_found(store, response_id, "previous_response_id")
        raise ApiError(404, f"response {response_id!r} is stored by model {model!r}, which runs "
                       "in a process of its own and keeps its responses there: send the "
                       f"follow-up to model {model!r} to continue it",
                       param="previous_response_id", code="response_not_found")  # fmt: skip

    async def elsewhere(request: Request, response_id: str) -> Response:
        """The answer of the isolated model's process that stores ``response_id`` (each keeps
        its own), else this store's 404."""
        answer = await children.answer(request)
        if answer is None:
            raise _not_found(store, response_id, "response_id")
        return answer

    async def create(body: ResponseRequest, client: Request) -> Any:
        llama, previous, own, messages, kwargs = await chat_call(body)
        stored = body.store and store.size > 0
        draft = wire.draft(body, state.model_name(body.model), stored)

        def remember(response: dict[str, Any]) -> None:
            if stored:
                output = INPUT_ITEMS.validate_python(response["output"])
                history = with_ids((*previous, *own, *output))
                own_input = history[len(previous) : len(previous) + len(own)]
                added = len(json.dumps(response)) + len(INPUT_ITEMS.dump_json(list(own_input)))
                store.put(response, history, added)

        if body.stream:
            chunks = await in_thread(partial(llama.stream_chat_completion, messages, **kwargs))
            write = partial(_events, ResponseEvents(draft, body.parallel_tool_calls), remember)
            return await sse_events(state, client, chunks, write)
        generation = partial(llama.create_chat_completion, messages, **kwargs)
        result = await complete(state, client, generation)
        response = wire.response(draft, result, body.parallel_tool_calls)
        remember(response)
        return response

    async def count_input_tokens(body: ResponseRequest) -> Any:
        """The prompt tokens ``POST /v1/responses`` would take for ``body`` (nothing is
        generated; what it refuses is refused here)."""
        call = await chat_call(body)
        count = await in_thread(partial(call.llama.count_chat_tokens, call.messages, **call.kwargs))
        return {"object": "response.input_tokens", "input_tokens": count}

    async def retrieve(response_id: str, request: Request, stream: bool = False) -> Any:
        if stream:  # the SDK would read this JSON as an empty event stream
            raise ApiError(400, "a stored response cannot be streamed again (OpenAI streams "
                           "background responses only, which are not supported)",
                           param="stream")  # fmt: skip
        stored = store.get(response_id)
        return stored.response if stored is not None else await elsewhere(request, response_id)

    async def cancel(response_id: str, request: Request) -> Any:
        if store.get(response_id) is None:  # an unknown one is the 404 retrieve answers
            return await elsewhere(request, response_id)
        raise ApiError(400, "only background responses can be cancelled, and this server runs "
                       "none: this one was complete when it was answered",
                       param="response_id")  # fmt: skip

    async def delete(response_id: str, request: Request) -> Any:
        if not store.delete(response_id):
            return await elsewhere(request, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(
        response_id: str,
        request: Request,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Order = "desc",
        include: Annotated[list[str] | None, Query()] = None,
        # The openai SDK's spelling of a list in a query string.
        include_listed: Annotated[list[str] | None, Query(alias="include[]")] = None,
    ) -> Any:
        check_includes((*(include or ()), *(include_listed or ())))
        stored = store.get(response_id)
        if stored is None:
            return await elsewhere(request, response_id)
        return page(stored.input_items, order, limit, after)

    for prefix, documented in (("/v1", True), ("", False)):
        app.add_api_route(f"{prefix}/responses", create, methods=["POST"],
                          response_model=ResponseObject, responses=ERRORS,
                          include_in_schema=documented)  # fmt: skip
        # Before /responses/{response_id}, whose path it matches too.
        app.add_api_route(f"{prefix}/responses/input_tokens", count_input_tokens,
                          methods=["POST"], response_model=InputTokens, responses=ERRORS,
                          include_in_schema=documented)  # fmt: skip
        app.add_api_route(f"{prefix}/responses/{{response_id}}", retrieve, methods=["GET"],
                          response_model=ResponseObject, responses=ERRORS,
                          include_in_schema=documented)  # fmt: skip
        app.add_api_route(f"{prefix}/responses/{{response_id}}", delete, methods=["DELETE"],
                          response_model=DeletedResponse, responses=ERRORS,
                          include_in_schema=documented)  # fmt: skip
        app.add_api_route(f"{prefix}/responses/{{response_id}}/cancel", cancel,
                          methods=["POST"], response_model=ResponseObject, responses=ERRORS,
                          include_in_schema=documented)  # fmt: skip
        app.add_api_route(f"{prefix}/responses/{{response_id}}/input_items", input_items,
                          methods=["GET"], response_model=InputItemList, responses=ERRORS,
                          include_in_schema=documented)  # fmt: skip


async def _events(
    events: ResponseEvents,
    remember: Callable[[dict[str, Any]], None],
    chunks: AsyncIterator[ChatCompletionChunk],
) -> AsyncIterator[str]:
    for event in events.start():
        yield frame(event)
    try:
        async for chunk in chunks:
            batch = events.chunk(chunk)
            if events.final is not None:  # before the last events: the client may then leave
                remember(events.final)
            for event in batch:
                yield frame(event)
    except ApiError as error:
        for event in events.failed(error):
            yield frame(event)


def _referenced(store: ResponseStore, item: RequestItem, index: int) -> InputItem:
    """``item``, or for a reference the stored item it names (404 where none is kept)."""
    if not isinstance(item, ItemReference):
        return item
    found = store.item(item.id)
    if found is None:
        raise ApiError(404, f"input[{index}]: item {item.id!r} is not stored here: "
                       f"{_kept(store)}", param=f"input[{index}].id",
                       code="item_not_found")  # fmt: skip
    return found


def _not_found(store: ResponseStore, response_id: str, param: str) -> ApiError:
    return ApiError(404, f"response {response_id!r} is not stored here: {_kept(store)}",
                    param=param, code="response_not_found")  # fmt: skip


def _kept(store: ResponseStore) -> str:
    if not store.size:
        return "this server stores no responses"
    return (f"this server keeps the last {store.size} responses (at most {store.max_bytes} "
            f"bytes of them) for {store.ttl:g} s, and none sent with store: false")  # fmt: skip
