"""Tools as the SDKs write them, on a Gemma server whose template cannot present tools (the
generic format): parameters with ``$defs`` (``openai.pydantic_function_tool`` of a nested
model) or draft-07 ``definitions`` on the chat, Responses and Messages routes, and a call cut
by max_tokens (the call so far, as OpenAI)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from live_server import running
from pydantic import BaseModel

from llamacrab.server import ServerSettings
from llamacrab.server._partial_json import partial_object

pytestmark = pytest.mark.real_model


class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    """Record a person."""

    name: str
    address: Address


PERSON_TOOL: Any = openai.pydantic_function_tool(Person)
PERSON_SCHEMA = PERSON_TOOL["function"]["parameters"]
ASK: Any = [{"role": "user", "content": "Record Ann, who lives in Paris, France."}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server_url(gemma_path: Path) -> Iterator[str]:
    settings = ServerSettings(model=str(gemma_path), n_ctx=2048, n_threads=2)
    for live in running(settings):
        yield live.url


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="x", max_retries=0)


def test_the_tool_schema_has_defs() -> None:
    assert "$defs" in PERSON_SCHEMA and "$ref" in json.dumps(PERSON_SCHEMA["properties"])


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_chat_with_a_pydantic_function_tool(client: openai.OpenAI, tool_choice: str) -> None:
    choice: Any = tool_choice
    if tool_choice != "required":
        choice = {"type": "function", "function": {"name": "Person"}}
    result = client.chat.completions.create(
        model="gemma", messages=ASK, tools=[PERSON_TOOL], tool_choice=choice, max_tokens=120,
        **GREEDY,  # type: ignore[arg-type]
    )  # fmt: skip
    [call] = result.choices[0].message.tool_calls or []
    assert result.choices[0].finish_reason == "tool_calls"
    assert call.type == "function" and call.function.name == "Person"
    Person.model_validate_json(call.function.arguments)


def test_chat_with_draft_07_definitions(client: openai.OpenAI) -> None:
    parameters = {
        "type": "object",
        "definitions": {"City": {"type": "string", "enum": ["Paris", "Lisbon"]}},
        "properties": {"city": {"$ref": "#/definitions/City"}},
        "required": ["city"],
        "$schema": "http://json-schema.org/draft-07/schema#",
    }
    tool: Any = {"type": "function", "function": {"name": "weather", "parameters": parameters}}
    result = client.chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
        tool_choice="required", max_tokens=60, **GREEDY,  # type: ignore[arg-type]
    )  # fmt: skip
    [call] = result.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Lisbon")


def test_responses_with_a_pydantic_function_tool(client: openai.OpenAI) -> None:
    tool: Any = {"type": "function", "name": "Person", "parameters": PERSON_SCHEMA,
                 "strict": True}  # fmt: skip
    response = client.responses.create(
        model="gemma", input=ASK, tools=[tool], tool_choice="required", max_output_tokens=120,
        temperature=0,
    )  # fmt: skip
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "Person" and response.status == "completed"
    Person.model_validate_json(call.arguments)


def test_messages_with_a_pydantic_input_schema(server_url: str) -> None:
    client = anthropic.Anthropic(base_url=server_url, api_key="x", max_retries=0)
    tool: Any = {"name": "Person", "description": "Record a person.",
                 "input_schema": PERSON_SCHEMA}  # fmt: skip
    message = client.messages.create(
        model="gemma", max_tokens=120, messages=ASK, tools=[tool],
        tool_choice={"type": "any"}, extra_body=GREEDY,
    )  # fmt: skip
    [use] = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and use.name == "Person"
    Person.model_validate(use.input)


# -- a call cut by max_tokens --------------------------------------------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
WEATHER_ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def budget(client: openai.OpenAI) -> int:
    """A max_tokens that ends the forced call after its name, inside its arguments."""
    for budget in range(10, 40, 2):
        result = client.chat.completions.create(
            model="gemma", messages=WEATHER_ASK, tools=[WEATHER], tool_choice="required",
            max_tokens=budget, **GREEDY,  # type: ignore[arg-type]
        )  # fmt: skip
        assert result.choices[0].finish_reason in ("length", "tool_calls")
        calls = result.choices[0].message.tool_calls
        if result.choices[0].finish_reason == "length" and calls and calls[0].function.arguments:
            return budget
    raise AssertionError("no budget cut the call after its name")


def test_a_cut_call_is_the_call_so_far_on_chat(client: openai.OpenAI, budget: int) -> None:
    result = client.chat.completions.create(
        model="gemma", messages=WEATHER_ASK, tools=[WEATHER], tool_choice="required",
        max_tokens=budget, **GREEDY,  # type: ignore[arg-type]
    )  # fmt: skip
    choice = result.choices[0]
    assert choice.finish_reason == "length" and result.usage is not None
    assert result.usage.completion_tokens == budget
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    with pytest.raises(json.JSONDecodeError):  # the arguments so far: cut
        json.loads(call.function.arguments)
    whole = client.chat.completions.create(
        model="gemma", messages=WEATHER_ASK, tools=[WEATHER], tool_choice="required",
        max_tokens=120, **GREEDY,  # type: ignore[arg-type]
    )  # fmt: skip
    [complete] = whole.choices[0].message.tool_calls or []
    squeezed = "".join(call.function.arguments.split())
    assert "".join(complete.function.arguments.split()).startswith(squeezed)
    chunks = list(client.chat.completions.create(
        model="gemma", messages=WEATHER_ASK, tools=[WEATHER], tool_choice="required",
        max_tokens=budget, stream=True, **GREEDY,  # type: ignore[arg-type]
    ))  # fmt: skip
    assert chunks[-1].choices[0].finish_reason == "length"
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas if d.function] == [
        ("get_weather", call.function.arguments)
    ]


def test_a_cut_call_on_responses_is_an_incomplete_item(client: openai.OpenAI, budget: int) -> None:
    tool: Any = {"type": "function", **WEATHER["function"]}
    response = client.responses.create(
        model="gemma", input=WEATHER_ASK, tools=[tool], tool_choice="required",
        max_output_tokens=budget, temperature=0,
    )  # fmt: skip
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "incomplete"


def test_a_cut_call_on_messages_holds_what_of_its_input_is_complete(
    client: openai.OpenAI, server_url: str, budget: int
) -> None:
    """A tool_use block holds an object: a cut call's input holds the members complete by
    then, as Anthropic's SDK reads a stream's, with stop_reason max_tokens (no 500)."""
    cut = client.chat.completions.create(
        model="gemma", messages=WEATHER_ASK, tools=[WEATHER], tool_choice="required",
        max_tokens=budget, **GREEDY,  # type: ignore[arg-type]
    )  # fmt: skip
    [call] = cut.choices[0].message.tool_calls or []
    expected = partial_object(call.function.arguments)
    assert isinstance(expected, dict)
    messages = anthropic.Anthropic(base_url=server_url, api_key="x", max_retries=0)
    tool: Any = {"name": "get_weather", "input_schema": CITY}
    kwargs: Any = {"model": "gemma", "max_tokens": budget, "messages": WEATHER_ASK, "tools": [tool],
                   "tool_choice": {"type": "any"}, "extra_body": GREEDY}  # fmt: skip
    message = messages.messages.create(**kwargs)
    assert message.stop_reason == "max_tokens"
    [block] = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == expected
    with messages.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "max_tokens"
    assert [(b.type, b.input) for b in streamed.content] == [("tool_use", expected)]
