"""OpenAI's Responses API (/v1/responses), driven by the official openai SDK against Gemma 3
270M on a live loopback server."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import jsonschema
import openai
import pydantic
import pytest
from live_server import LiveServer, running
from openai.types.responses import (
    Response,
    ResponseFunctionToolCallItem,
    ResponseFunctionToolCallOutputItem,
    ResponseInputMessageItem,
    ResponseItem,
    ResponseOutputMessage,
    ResponseStreamEvent,
)

from llamacrab._types import ChatCompletionChunk, ChatDelta
from llamacrab.server import ServerSettings
from llamacrab.server._errors import ApiError
from llamacrab.server._responses_events import ResponseEvents
from llamacrab.server._responses_items import listed, page, with_ids
from llamacrab.server._responses_schemas import INPUT_ITEMS, ResponseRequest
from llamacrab.server._responses_store import ResponseStore
from llamacrab.server._responses_wire import draft

KEY = "sesame"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Lisbon"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
FORCED = {"type": "function", "name": "get_weather"}
# Gemma's turn format, presenting tools, tool calls and their results (Gemma 3's own template
# presents no tools).
GEMMA_WITH_TOOLS = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'assistant' %}<start_of_turn>model\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}'
    "{% endfor %}<end_of_turn>\n"
    "{% elif m.role == 'tool' %}<start_of_turn>user\n"
    "{{ m.name }} returned: {{ m.content }}<end_of_turn>\n"
    "{% else %}<start_of_turn>user\n"
    "{% if loop.first and tools %}You can call these functions:"
    "{% for t in tools %} {{ t.function.name }}: {{ t.function.description }}.{% endfor %}\n"
    "{% endif %}{{ m.content }}<end_of_turn>\n"
    "{% endif %}{% endfor %}<start_of_turn>model\n{{ '' }}"
)


@pytest.fixture(scope="module")
def gemma_server(gemma_path: Path) -> Iterator[LiveServer]:
    """Gemma with its own chat format, behind an API key."""
    settings = ServerSettings(model=str(gemma_path), model_alias="gemma", parallel=2,
                              n_ctx=2 * 1024, n_threads=2, api_keys=(KEY,),
                              max_tokens_limit=256)  # fmt: skip
    yield from running(settings)


@pytest.fixture(scope="module")
def tools_server(gemma_path: Path) -> Iterator[LiveServer]:
    """Gemma with a chat template that presents tools."""
    settings = ServerSettings(model=str(gemma_path), model_alias="gemma", n_ctx=1024,
                              n_threads=2, chat_template=GEMMA_WITH_TOOLS)  # fmt: skip
    yield from running(settings)


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def answer(client: openai.OpenAI, **kwargs: Any) -> Any:
    options = {"model": "gemma", "max_output_tokens": 12, "temperature": 0, **kwargs}
    return client.responses.create(**options)


# -- text ----------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_text_with_instructions_is_the_chat_answer(gemma_server: LiveServer) -> None:
    client = sdk(gemma_server)
    result = answer(client, instructions="Answer briefly.", input="Name a large animal.")
    chat = client.chat.completions.create(
        model="gemma", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "Name a large animal."}],
    )  # fmt: skip
    assert result.object == "response" and result.id.startswith("resp_")
    assert result.output_text == chat.choices[0].message.content
    [message] = result.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"  # type: ignore[union-attr]
    usage = result.usage
    assert usage is not None and usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
    assert usage.output_tokens == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    # The chat left this prompt in a slot: asked again, all of it but the last token is reused.
    again = answer(client, instructions="Answer briefly.", input="Name a large animal.")
    assert again.output_text == result.output_text
    assert again.usage.input_tokens_details.cached_tokens == usage.input_tokens - 1
    assert result.instructions == "Answer briefly." and result.model == "gemma"
    raw = client.responses.with_raw_response.create(
        model="gemma", input="Hi", max_output_tokens=2,
        reasoning={"effort": "low", "summary": "auto"},  # a template variable; no summary
    )  # fmt: skip
    strict = Response.model_validate(raw.http_response.json())  # every required field
    assert strict.reasoning is not None and strict.reasoning.effort == "low"
    assert [item.type for item in strict.output] == ["message"]
    if usage.output_tokens == 12:  # cut short
        assert result.status == "incomplete" and message.status == "incomplete"
        assert result.incomplete_details and result.incomplete_details.reason == "max_output_tokens"
    else:
        assert result.status == "completed"


@pytest.mark.real_model
def test_multi_turn_by_items_and_by_previous_response_id(gemma_server: LiveServer) -> None:
    client = sdk(gemma_server)
    first = answer(client, input="Name a colour.", max_output_tokens=8)
    chained = answer(client, previous_response_id=first.id, input="Name another one.")
    replayed = answer(client, input=[
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": [{"type": "input_text", "text": "Name another one."}]},
    ])  # fmt: skip
    assert chained.output_text == replayed.output_text
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == replayed.usage.input_tokens  # type: ignore[union-attr]
    assert chained.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
    stored = client.responses.retrieve(chained.id)
    assert stored.output_text == chained.output_text and stored.status == chained.status
    # The Vercel AI SDK's way while responses are stored: earlier answers by reference.
    referenced = answer(client, input=[
        {"role": "user", "content": "Name a colour."},
        {"type": "item_reference", "id": first.output[0].id},
        {"role": "user", "content": "Name another one."},
    ])  # fmt: skip
    assert referenced.output_text == replayed.output_text
    assert referenced.usage.input_tokens == replayed.usage.input_tokens  # type: ignore[union-attr]
    items = client.responses.input_items.list(referenced.id, order="asc").data
    assert [getattr(item, "role", None) for item in items] == ["user", "assistant", "user"]
    assert items[1].id == first.output[0].id
    bare = answer(client, input=[  # the SDK's ItemReference may leave its type out
        {"role": "user", "content": "Name a colour."},
        {"id": first.output[0].id},
        {"role": "user", "content": "Name another one."},
    ])  # fmt: skip
    assert bare.output_text == replayed.output_text
    with pytest.raises(openai.NotFoundError, match="'msg_gone' is not stored here") as gone:
        answer(client, input=[{"type": "item_reference", "id": "msg_gone"}])
    assert gone.value.body["param"] == "input[0].id"  # type: ignore[index]


@pytest.mark.real_model
def test_store_false_and_deleted_responses_are_not_kept(gemma_server: LiveServer) -> None:
    client = sdk(gemma_server)
    unstored = answer(client, input="Say hi.", max_output_tokens=2, store=False)
    assert unstored.store is False
    kept = answer(client, input="Say hi.", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    with pytest.raises(openai.BadRequestError, match="cannot be streamed again"):
        list(client.responses.retrieve(kept.id, stream=True))  # was an empty event stream
    with pytest.raises(openai.BadRequestError, match="only background responses"):
        client.responses.cancel(kept.id)  # it was complete when answered (was a 404)
    client.responses.delete(kept.id)
    for gone in (unstored.id, kept.id):
        with pytest.raises(openai.NotFoundError, match="is not stored here"):
            client.responses.cancel(gone)
        with pytest.raises(openai.NotFoundError, match="is not stored here") as error:
            answer(client, previous_response_id=gone, input="Again.")
        assert error.value.body["param"] == "previous_response_id"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)


# -- streaming -----------------------------------------------------------------------------------


@pytest.mark.real_model
def test_stream_events_in_order_and_deltas_make_the_text(gemma_server: LiveServer) -> None:
    client = sdk(gemma_server)
    whole = answer(client, input="Count from one to five.", max_output_tokens=16)
    events = list(answer(client, input="Count from one to five.", max_output_tokens=16,
                         stream=True))  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert deltas > 0
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        final,
    ]  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == whole.output_text
    assert events[-1].response.output_text == text  # type: ignore[union-attr]
    usage = events[-1].response.usage  # type: ignore[union-attr]
    assert (usage.input_tokens, usage.output_tokens) == (whole.usage.input_tokens,
                                                         whole.usage.output_tokens)  # fmt: skip
    assert events[-4].text == text  # type: ignore[union-attr]


# -- tools and structured output -----------------------------------------------------------------


@pytest.mark.real_model
def test_a_forced_function_call_round_trip(tools_server: LiveServer) -> None:
    client = sdk(tools_server)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = answer(client, input=question, tools=[WEATHER], tool_choice=FORCED,
                    max_output_tokens=40)  # fmt: skip
    assert called.status == "completed"
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    by_items = answer(client, input=[*question, call.model_dump(), result], tools=[WEATHER])
    by_id = answer(client, previous_response_id=called.id, input=[result], tools=[WEATHER])
    for reply in (by_items, by_id):
        assert [item.type for item in reply.output] == ["message"]
        assert reply.output_text
    assert by_id.output_text == by_items.output_text


@pytest.mark.real_model
def test_a_streamed_function_call(tools_server: LiveServer) -> None:
    client = sdk(tools_server)
    with client.responses.stream(model="gemma", input="Weather in Lisbon?", tools=[WEATHER],  # type: ignore[arg-type]
                                 tool_choice=FORCED, max_output_tokens=40,  # type: ignore[arg-type]
                                 temperature=0) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-5:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    [call] = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Lisbon")


@pytest.mark.real_model
def test_json_schema_text_format(gemma_server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    result = answer(sdk(gemma_server), input="Describe a person as JSON.", max_output_tokens=64,
                    text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                     "strict": True}})  # fmt: skip
    jsonschema.validate(json.loads(result.output_text), schema)
    assert result.text.format.type == "json_schema"  # type: ignore[union-attr]


# -- refusals and guards -------------------------------------------------------------------------


# Requests /v1/responses refuses (and /v1/responses/input_tokens with them): the options, the
# param named, words of the message.
REFUSALS = [
    ({"tools": [{"type": "web_search_preview"}]}, "tools", "'web_search_preview' is not"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "'file_search' is not"),
    ({"background": True}, "background", "background responses are not supported"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input", "'web_search_call' is not"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input", "input[0].content[0]: content type 'input_file'"),
    ({"include": ["message.output_text.logprobs"]}, "include", "is not supported"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id", "is not stored"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
     "needs a schema"),
    ({"input": []}, "input", "nothing to answer"),
]  # fmt: skip


@pytest.mark.real_model
@pytest.mark.parametrize(("options", "param", "words"), REFUSALS)
def test_what_is_refused_is_named(
    gemma_server: LiveServer, options: dict[str, Any], param: str, words: str
) -> None:
    options = {"input": "hi", **options}
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as error:
        answer(sdk(gemma_server), **options)
    assert error.value.body["param"] == param  # type: ignore[index]
    assert words in error.value.message


@pytest.mark.real_model
def test_the_route_sits_behind_the_key_and_is_counted(gemma_server: LiveServer) -> None:
    body = {"model": "gemma", "input": "hi", "max_output_tokens": 1}
    assert httpx.post(gemma_server.url + "/v1/responses", json=body).status_code == 401
    headers = {"Authorization": f"Bearer {KEY}"}
    short = httpx.post(gemma_server.url + "/responses", json=body, headers=headers, timeout=60)
    assert short.status_code == 200 and short.json()["usage"]["output_tokens"] == 1
    metrics = httpx.get(gemma_server.url + "/metrics", headers=headers).text
    assert 'route="/responses",status="200"' in metrics
    schema = httpx.get(gemma_server.url + "/openapi.json", headers=headers).json()
    assert "/v1/responses" in schema["paths"]


# -- input items ---------------------------------------------------------------------------------

ITEM_TYPES = pydantic.TypeAdapter(ResponseItem)
STREAM_EVENTS: pydantic.TypeAdapter[ResponseStreamEvent] = pydantic.TypeAdapter(ResponseStreamEvent)


def strict_items(client: openai.OpenAI, response_id: str, **query: Any) -> dict[str, Any]:
    """A page of input items as answered, every item validated by the SDK's types (the SDK
    itself builds them without validating)."""
    raw = client.responses.input_items.with_raw_response.list(response_id, **query)
    page = raw.http_response.json()
    page["data"] = [ITEM_TYPES.validate_python(item) for item in page["data"]]
    return page  # type: ignore[no-any-return]


def ids(items: Any) -> list[str]:
    return [item.id for item in items]


@pytest.fixture(scope="module")
def chained(gemma_server: LiveServer) -> tuple[Response, Response]:
    """A response, and one after it (previous_response_id) with two messages of its own."""
    client = sdk(gemma_server)
    first = answer(client, instructions="Answer briefly.", input="Name a colour.",
                   max_output_tokens=4)  # fmt: skip
    second = answer(client, previous_response_id=first.id, max_output_tokens=4, input=[
        {"role": "developer", "content": "Use one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "Another one."}]},
    ])  # fmt: skip
    return first, second


@pytest.mark.real_model
def test_input_items_are_the_conversation_newest_first(
    gemma_server: LiveServer, chained: tuple[Response, Response]
) -> None:
    client = sdk(gemma_server)
    first, second = chained
    page = strict_items(client, second.id)
    newest_first = page["data"]
    # The earlier response's input and output come first: the model was given them too.
    assert [type(item) for item in reversed(newest_first)] == [
        ResponseInputMessageItem, ResponseOutputMessage, ResponseInputMessageItem,
        ResponseInputMessageItem,
    ]  # fmt: skip
    asked, answered, developer, user = reversed(newest_first)
    assert asked.role == "user" and asked.content[0].text == "Name a colour."
    assert answered.id == first.output[0].id and answered.status == first.output[0].status
    assert answered.content[0].text == first.output_text
    assert developer.role == "developer" and developer.content[0].text == "Use one word."
    assert user.content[0].type == "input_text" and user.content[0].text == "Another one."
    assert {item.status for item in (asked, developer, user)} == {"completed"}
    all_ids = ids(newest_first)
    assert len(set(all_ids)) == 4 and all(i.startswith("msg_") for i in all_ids)
    assert (page["object"], page["has_more"]) == ("list", False)
    assert (page["first_id"], page["last_id"]) == (all_ids[0], all_ids[-1])
    # In order, the same items; the ids were given once, when each response was stored.
    assert ids(client.responses.input_items.list(second.id, order="asc")) == all_ids[::-1]
    assert ids(client.responses.input_items.list(second.id)) == all_ids
    assert ids(client.responses.input_items.list(first.id)) == [asked.id]
    harmless = ["reasoning.encrypted_content", "message.input_image.image_url"]
    assert ids(client.responses.input_items.list(second.id, include=harmless)) == all_ids  # type: ignore[arg-type]


@pytest.mark.real_model
@pytest.mark.parametrize("order", ["asc", "desc"])
def test_pages_of_one_walk_every_item(
    gemma_server: LiveServer, chained: tuple[Response, Response], order: str
) -> None:
    client = sdk(gemma_server)
    second = chained[1]
    every = ids(client.responses.input_items.list(second.id, order=order))  # type: ignore[arg-type]
    walked, after = [], None
    while True:
        options = {} if after is None else {"after": after}
        page = client.responses.input_items.list(second.id, order=order, limit=1, **options)  # type: ignore[arg-type]
        [item] = page.data
        assert page.first_id == page.last_id == item.id  # type: ignore[attr-defined]
        walked.append(item.id)
        if not page.has_more:
            break
        after = item.id
    assert walked == every and len(every) == 4
    assert ids(client.responses.input_items.list(second.id, order=order, limit=1)) == every  # type: ignore[arg-type]
    rest = client.responses.input_items.list(second.id, order=order, limit=2, after=every[0])  # type: ignore[arg-type]
    assert ids(rest.data) == every[1:3] and rest.has_more
    past_the_end = strict_items(client, second.id, order=order, after=every[-1])
    assert past_the_end["data"] == [] and past_the_end["has_more"] is False
    assert past_the_end["first_id"] is None and past_the_end["last_id"] is None


class ToolRoundTrip(NamedTuple):
    question: list[dict[str, Any]]
    called: Any  # the response with the forced call
    call: Any  # its function_call item
    result: dict[str, Any]  # the call's output, sent back
    reply: Any  # the response to it


def tool_round_trip(client: openai.OpenAI) -> ToolRoundTrip:
    """A forced call of WEATHER, then its output sent back by previous_response_id."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = answer(client, input=question, tools=[WEATHER], tool_choice=FORCED,
                    max_output_tokens=40)  # fmt: skip
    [call] = called.output
    assert call.type == "function_call"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    reply = answer(client, previous_response_id=called.id, input=[result], tools=[WEATHER])
    return ToolRoundTrip(question, called, call, result, reply)


@pytest.mark.real_model
def test_function_calls_and_their_outputs_are_listed(tools_server: LiveServer) -> None:
    client = sdk(tools_server)
    question, _, call, result, reply = tool_round_trip(client)
    asked, listed_call, output = strict_items(client, reply.id, order="asc")["data"]
    assert isinstance(asked, ResponseInputMessageItem)
    assert isinstance(listed_call, ResponseFunctionToolCallItem)
    assert listed_call.model_dump() == {**call.model_dump(), "created_by": None}
    assert isinstance(output, ResponseFunctionToolCallOutputItem)
    assert output.id.startswith("fco_") and output.status == "completed"
    assert (output.call_id, output.output) == (call.call_id, "Sunny, 24 C")
    # Items the client sends keep their ids; one repeated gets another (ids stay unique).
    resent = answer(client, input=[*question, call.model_dump(), result, call.model_dump()],
                    tools=[WEATHER], max_output_tokens=2)  # fmt: skip
    listed = list(client.responses.input_items.list(resent.id, order="asc"))
    assert [item.type for item in listed] == ["message", "function_call",
                                              "function_call_output", "function_call"]  # fmt: skip
    assert listed[1].id == call.id and listed[3].id not in (call.id, None)
    assert len(set(ids(listed))) == 4


@pytest.mark.real_model
def test_listing_unknown_responses_is_404_as_retrieving(gemma_server: LiveServer) -> None:
    client = sdk(gemma_server)
    unstored = answer(client, input="Say hi.", max_output_tokens=2, store=False)
    deleted = answer(client, input="Say hi.", max_output_tokens=2)
    client.responses.delete(deleted.id)
    for gone in ("resp_unknown", unstored.id, deleted.id):
        with pytest.raises(openai.NotFoundError) as listing:
            client.responses.input_items.list(gone)
        with pytest.raises(openai.NotFoundError) as retrieving:
            client.responses.retrieve(gone)
        assert listing.value.body == retrieving.value.body
        assert listing.value.body["param"] == "response_id"  # type: ignore[index]


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("query", "param", "words"),
    [
        ("limit=0", "limit", "greater than or equal to 1"),
        ("limit=-5", "limit", "greater than or equal to 1"),
        ("limit=101", "limit", "less than or equal to 100"),
        ("limit=" + "9" * 5000, "limit", "integer"),
        ("limit=twenty", "limit", "valid integer"),
        ("order=newest", "order", "'asc' or 'desc'"),
        ("after=msg_unknown", "after", "no input item 'msg_unknown'"),
        ("after=" + "x" * 60_000, "after", "no input item 'xxx"),
        ("include[]=message.output_text.logprobs", "include", "'message.output_text.logprobs'"),
        ("include=file_search_call.everything", "include", "is not supported"),
    ],
)  # fmt: skip
def test_bad_pages_are_refused_by_name(
    gemma_server: LiveServer, chained: tuple[Response, Response], query: str, param: str,
    words: str,
) -> None:  # fmt: skip
    url = f"{gemma_server.url}/v1/responses/{chained[1].id}/input_items?{query}"
    refused = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert len(error["message"]) < 300  # a long id is not echoed whole


@pytest.mark.real_model
def test_an_after_too_long_for_http_is_refused_and_the_server_lives_on(
    gemma_server: LiveServer, chained: tuple[Response, Response]
) -> None:
    host, port = gemma_server.url.removeprefix("http://").split(":")
    target = f"/v1/responses/{chained[1].id}/input_items?after={'x' * 100_000}"
    request = f"GET {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(f"{request}Connection: close\r\n\r\n".encode())
        status_line = connection.makefile("rb").readline()
    assert status_line.split()[1] == b"400"  # uvicorn's, before any route: an HTTP limit
    assert httpx.get(gemma_server.url + "/health").status_code == 200
    assert ids(sdk(gemma_server).responses.input_items.list(chained[1].id, limit=1))


# -- input tokens --------------------------------------------------------------------------------


def count(client: openai.OpenAI, **body: Any) -> int:
    counted = client.responses.input_tokens.count(model="gemma", **body)
    assert counted.object == "response.input_tokens"
    return counted.input_tokens


def prompt_tokens_processed(server: LiveServer) -> str:
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    [line] = [x for x in metrics.text.splitlines() if x.startswith("llamacrab_prompt_tokens")]
    return line


@pytest.mark.real_model
def test_input_tokens_are_a_response_usage_input_tokens(
    gemma_server: LiveServer, chained: tuple[Response, Response]
) -> None:
    client = sdk(gemma_server)
    first, second = chained
    processed = prompt_tokens_processed(gemma_server)
    with_instructions = count(client, instructions="Answer briefly.", input="Name a colour.")
    assert with_instructions == first.usage.input_tokens  # type: ignore[union-attr]
    assert count(client, input="Name a colour.") < with_instructions
    following = count(client, previous_response_id=first.id, input=[
        {"role": "developer", "content": "Use one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "Another one."}]},
    ])  # fmt: skip
    assert following == second.usage.input_tokens  # type: ignore[union-attr]
    assert prompt_tokens_processed(gemma_server) == processed  # nothing was decoded
    # Without /v1 too, behind the key like every route.
    url, body = gemma_server.url + "/responses/input_tokens", {"input": "Name a colour."}
    assert httpx.post(url, json=body).status_code == 401
    counted = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert counted.json() == {"object": "response.input_tokens",
                              "input_tokens": count(client, input="Name a colour.")}  # fmt: skip


@pytest.mark.real_model
def test_input_tokens_with_tools_are_the_response_usage(tools_server: LiveServer) -> None:
    client = sdk(tools_server)
    question, called, _, result, reply = tool_round_trip(client)
    assert count(client, input=question, tools=[WEATHER]) == called.usage.input_tokens
    assert count(client, input=question) < called.usage.input_tokens
    by_id = count(client, previous_response_id=called.id, input=[result], tools=[WEATHER])
    assert by_id == reply.usage.input_tokens


@pytest.mark.real_model
def test_input_tokens_are_the_prompt_the_chat_engine_builds(gemma_server: LiveServer) -> None:
    # Gemma 3's own template presents no tools: "none" leaves them out, "auto" describes them
    # in a system turn; a forced call that cannot be refuses alike on both routes.
    client = sdk(gemma_server)
    for choice in ("none", "auto"):
        options = {"input": "What is the weather in Paris?", "tools": [WEATHER],
                   "tool_choice": choice}  # fmt: skip
        assert count(client, **options) == answer(client, **options).usage.input_tokens
    assert count(client, input="hi", tools=[WEATHER], tool_choice="none") == count(
        client, input="hi"
    )
    for bad in ({"type": "function", "name": "nope"}, "required"):
        extra = {} if bad != "required" else {"text": {"format": {"type": "json_object"}}}
        messages = []
        for call in (answer, count):
            with pytest.raises(openai.BadRequestError) as error:
                call(client, input="hi", tools=[WEATHER], tool_choice=bad, **extra)
            messages.append(error.value.message)
        assert messages[0] == messages[1]


@pytest.mark.real_model
@pytest.mark.parametrize(("options", "param", "words"), REFUSALS)
def test_input_tokens_refuse_what_responses_refuse(
    gemma_server: LiveServer, options: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as error:
        count(sdk(gemma_server), extra_body={"input": "hi", **options})
    assert error.value.body["param"] == param  # type: ignore[index]
    assert words in error.value.message


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        # Deeper than JSON parsers go (Python's stops near 1,000 levels).
        ('{"input": "hi", "metadata": ' + "[" * 10_000 + "]" * 10_000 + "}", 400,
         "nests deeper than this server reads"),
        ('{"input": "hi", "metadata": ' + '{"a": ' * 900 + "1" + "}" * 900 + "}", 400,
         "metadata.a: Input should be a valid string"),
        ('{"input": "hi", "instructions": 7}', 400, "instructions: Input should be a valid"),
        ('{"input": "hi"', 400, "not valid JSON"),
    ],
)  # fmt: skip
def test_hostile_input_tokens_bodies_are_refused(
    gemma_server: LiveServer, body: str, status: int, words: str
) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = gemma_server.url + "/v1/responses/input_tokens"
    refused = httpx.post(url, content=body, headers=headers, timeout=60)
    assert refused.status_code == status and words in refused.json()["error"]["message"]
    assert httpx.get(gemma_server.url + "/health").status_code == 200
    assert count(sdk(gemma_server), input="hi") > 0


# -- the store -----------------------------------------------------------------------------------


def _response(response_id: str) -> dict[str, Any]:
    return {"id": response_id}


def test_the_store_keeps_the_newest_responses_for_their_time() -> None:
    now = [0.0]
    store = ResponseStore(size=2, ttl=60, clock=lambda: now[0])
    for name in ("a", "b", "c"):
        store.put(_response(name), (), 1)
        now[0] += 10
    assert store.get("a") is None  # pushed out by the third
    assert store.get("b") is not None and store.get("c") is not None
    now[0] = 70  # b was stored at 10: gone at 70; c at 20
    assert store.get("b") is None and store.get("c") is not None
    assert store.delete("c") and not store.delete("c")
    nothing = ResponseStore(size=0, ttl=60)
    nothing.put(_response("a"), (), 1)
    assert nothing.get("a") is None


def test_the_store_keeps_at_most_its_bytes() -> None:
    # Without a byte bound, 256 requests of 8 MiB (a client's metadata or input) stayed an hour.
    store = ResponseStore(size=10, ttl=60, max_bytes=100)
    store.put(_response("a"), (), 60)
    store.put(_response("b"), (), 30)
    store.put(_response("c"), (), 30)  # 120 bytes: the oldest goes
    assert store.get("a") is None and store.get("b") and store.get("c")
    store.put(_response("huge"), (), 101)  # larger than the whole bound: not kept
    assert store.get("huge") is None and store.get("b") and store.get("c")
    assert store.delete("b")
    store.put(_response("d"), (), 70)  # 30 + 70: both fit
    assert store.get("c") and store.get("d")


def test_items_are_found_by_id_while_a_history_holding_them_is_kept() -> None:
    now = [0.0]
    store = ResponseStore(size=2, ttl=60, clock=lambda: now[0])
    turn = [{"role": "user", "content": "Hi", "id": "u"}, {"role": "assistant", "content": "Hey"}]
    first = with_ids(INPUT_ITEMS.validate_python(turn))
    answer = first[1].id
    assert answer is not None and answer.startswith("msg_")
    store.put(_response("a"), first, 1)
    follow_up = with_ids((*first, *INPUT_ITEMS.validate_python([{"role": "user", "content": "?"}])))
    store.put(_response("b"), follow_up, 1)  # shares the first two items
    assert store.item("u") is first[0] and store.item(answer) is first[1]
    assert store.delete("a")  # b still holds them
    assert store.item("u") is first[0] and store.item(follow_up[2].id or "") is follow_up[2]
    now[0] = 61  # b expired: nothing holds them
    assert store.item("u") is None and store.item(answer) is None
    # A client's id may come again in another conversation: the newest kept one answers,
    # and a deleted response's item is never found again.
    one, two = (with_ids(INPUT_ITEMS.validate_python([{"role": "user", "content": text,
                                                       "id": "m"}])) for text in "ab")  # fmt: skip
    store.put(_response("c"), one, 1)
    store.put(_response("d"), two, 1)
    assert store.item("m") is two[0]
    assert store.delete("d") and store.item("m") is one[0]
    store.put(_response("c"), one, 1)  # stored again under its id: still one holder
    assert store.delete("c") and store.item("m") is None


def test_stored_items_keep_their_ids_and_repeated_ones_get_new() -> None:
    sent = INPUT_ITEMS.validate_python([
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "Sunny"},
        {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": "{}"},
    ])  # fmt: skip
    identified = with_ids(sent)
    given = [listed(item)["id"] for item in identified]
    assert given[1] == "fc_1" and identified[1] is sent[1]  # kept, not copied
    assert given[0].startswith("msg_") and given[2].startswith("fco_")
    assert given[3].startswith("fc_") and len(set(given)) == 4
    again = with_ids(identified)  # a follow-up's history: nothing changes
    assert all(new is old for new, old in zip(again, identified, strict=True))


def test_content_parts_are_listed_in_the_sdk_shapes() -> None:
    image = "data:image/png;base64,iVBORw0KGgo="
    items = with_ids(INPUT_ITEMS.validate_python([
        {"role": "user", "content": [{"type": "input_text", "text": "See"},
                                     {"type": "input_image", "image_url": image}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "No."},
                                          {"type": "refusal", "refusal": "I can't."}]},
        {"role": "system", "content": "Be kind.", "status": "incomplete"},
        {"type": "function_call_output", "call_id": "c",
         "output": [{"type": "input_text", "text": "24 C"}]},
    ]))  # fmt: skip
    data = page(items, "asc", 20, None)["data"]
    user, assistant, system, output = map(ITEM_TYPES.validate_python, data)
    assert isinstance(user, ResponseInputMessageItem)
    assert [part.type for part in user.content] == ["input_text", "input_image"]
    assert user.content[1].image_url == image and user.content[1].detail == "auto"  # type: ignore[union-attr]
    assert isinstance(assistant, ResponseOutputMessage) and assistant.status == "completed"
    assert [part.type for part in assistant.content] == ["output_text", "refusal"]
    assert isinstance(system, ResponseInputMessageItem) and system.status == "incomplete"
    assert system.content[0].text == "Be kind."  # type: ignore[union-attr]
    assert isinstance(output, ResponseFunctionToolCallOutputItem)
    assert output.output[0].text == "24 C"  # type: ignore[union-attr]


def test_a_stream_failing_mid_answer_keeps_the_text_it_streamed() -> None:
    # The SDK takes response.failed's output as the response's: it was empty, and the streamed
    # text vanished from its snapshot.
    request = ResponseRequest.model_validate({"model": "m", "input": "Tell a story."})
    events = ResponseEvents(draft(request, "m", stored=False), parallel_tool_calls=True)
    streamed = [*events.start()]
    for piece in ("Once", " upon"):
        chunk = ChatCompletionChunk("chatcmpl-1", 0, "m", 0, ChatDelta(None, piece, ()), None)
        streamed += events.chunk(chunk)
    streamed += events.failed(ApiError(504, "the request ran past 3 s", code="timeout"))
    parsed = [STREAM_EVENTS.validate_python(event) for event in streamed]
    kinds = [event.type for event in parsed]
    assert kinds[-5:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "error", "response.failed"]  # fmt: skip
    failed = parsed[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None
    [message] = failed.output
    assert isinstance(message, ResponseOutputMessage) and message.status == "incomplete"
    assert message.content[0].text == "Once upon"  # type: ignore[union-attr]
    assert [event.sequence_number for event in parsed] == list(range(len(parsed)))
