"""OpenAI's Responses API (/v1/responses), driven by the official openai SDK against Gemma 3
270M on a live loopback server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from live_server import LiveServer
from openai.types.responses import Response

from llamacrab.server import ServerSettings
from llamacrab.server._responses_store import ResponseStore

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


def _running(settings: ServerSettings) -> Iterator[LiveServer]:
    server = LiveServer(settings)
    try:
        assert server.wait_until_loaded() == 200
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def gemma_server(gemma_path: Path) -> Iterator[LiveServer]:
    """Gemma with its own chat format, behind an API key."""
    settings = ServerSettings(model=str(gemma_path), model_alias="gemma", parallel=2,
                              n_ctx=2 * 1024, n_threads=2, api_keys=(KEY,),
                              max_tokens_limit=256)  # fmt: skip
    yield from _running(settings)


@pytest.fixture(scope="module")
def tools_server(gemma_path: Path) -> Iterator[LiveServer]:
    """Gemma with a chat template that presents tools."""
    settings = ServerSettings(model=str(gemma_path), model_alias="gemma", n_ctx=1024,
                              n_threads=2, chat_template=GEMMA_WITH_TOOLS)  # fmt: skip
    yield from _running(settings)


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
    assert usage.input_tokens_details.cached_tokens >= 0
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


@pytest.mark.real_model
def test_store_false_and_deleted_responses_are_not_kept(gemma_server: LiveServer) -> None:
    client = sdk(gemma_server)
    unstored = answer(client, input="Say hi.", max_output_tokens=2, store=False)
    assert unstored.store is False
    kept = answer(client, input="Say hi.", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    with pytest.raises(openai.BadRequestError, match="cannot be streamed again"):
        list(client.responses.retrieve(kept.id, stream=True))  # was an empty event stream
    client.responses.delete(kept.id)
    for gone in (unstored.id, kept.id):
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


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("options", "param", "words"),
    [
        ({"tools": [{"type": "web_search_preview"}]}, "tools", "'web_search_preview' is not"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice", "'file_search' is not"),
        ({"background": True}, "background", "background responses are not supported"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference' is not"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input", "input[0].content[0]: content type 'input_file'"),
        ({"include": ["message.output_text.logprobs"]}, "include", "is not supported"),
        ({"truncation": "auto"}, "truncation", "truncation"),
        ({"max_output_tokens": 10_000}, "max_output_tokens", "limit of 256"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id", "is not stored"),
    ],
)  # fmt: skip
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
