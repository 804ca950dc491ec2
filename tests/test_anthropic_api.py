"""Anthropic's Messages API on our server, driven by the official anthropic SDK against Gemma.

The SDK sends sampling settings it no longer types through ``extra_body``; greedy decoding
makes each answer comparable with the Python API's."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from anthropic.types import TextBlock, ToolUseBlock
from live_server import LiveServer
from test_multimodal import IMAGE_TOKENS, PIXELS, encoded

from llamacrab import Llama
from llamacrab.server import ServerSettings

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
mmproj = load_repo_module("scripts/make_tiny_mmproj.py")

KEY = "sesame"
GREEDY = {"temperature": 0}
# Gemma's turns, with a way to show tools, calls and results (Gemma's GGUF has no template,
# and the built-in gemma format cannot present tools). Calls are generic JSON, as a forced
# tool_choice writes them.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<start_of_turn>user\nTools (answer with a JSON call to use one):\n"
    "{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}<end_of_turn>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<start_of_turn>model\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}'
    "{% endfor %}<end_of_turn>\n"
    "{% elif m.role == 'tool' %}<start_of_turn>user\nResult: {{ m.content }}<end_of_turn>\n"
    "{% else %}<start_of_turn>user\n{{ m.content }}<end_of_turn>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Lisbon"]}},
        "required": ["city"],
    },
}
COUNT: Any = [{"role": "user", "content": "Count from one to ten in words."}]


@pytest.fixture(scope="module")
def server(gemma_path: Path) -> Iterator[LiveServer]:
    settings = ServerSettings(model=str(gemma_path), model_alias="gemma", api_keys=(KEY,),
                              chat_template=TEMPLATE, parallel=2, n_ctx=2 * 1024,
                              n_threads=2, max_tokens_limit=256)  # fmt: skip
    live = LiveServer(settings)
    try:
        assert live.wait_until_loaded() == 200
        yield live
    finally:
        live.close()


@pytest.fixture(scope="module")
def reference(gemma_path: Path) -> Iterator[Llama]:
    """The Python API with the server's template: what each answer should be."""
    with Llama(gemma_path, n_ctx=1024, n_threads=2, chat_format=TEMPLATE) as llm:
        yield llm


@pytest.fixture
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if isinstance(b, TextBlock))


# -- answers -------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_a_system_prompt_and_a_question(client: anthropic.Anthropic, reference: Llama) -> None:
    question = "What is the capital of France?"
    message = client.messages.create(
        model="gemma", max_tokens=12, system="Answer briefly.", extra_body=GREEDY,
        messages=[{"role": "user", "content": question}],
    )  # fmt: skip
    expected = reference.create_chat_completion(
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}],
        max_tokens=12, temperature=0,
    )  # fmt: skip
    assert message.type == "message" and message.role == "assistant" and message.model == "gemma"
    assert message.id.startswith("msg_")
    assert _text(message) == expected.text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens == 12
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == (
        expected.usage.prompt_tokens
    )


@pytest.mark.real_model
def test_multi_turn_with_system_blocks(client: anthropic.Anthropic, reference: Llama) -> None:
    turns: list[Any] = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello Ada."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is my name?"}]},
    ]
    system: Any = [{"type": "text", "text": "You are kind."}]
    message = client.messages.create(model="gemma", max_tokens=10, system=system,
                                     messages=turns, extra_body=GREEDY)  # fmt: skip
    expected = reference.create_chat_completion(
        [{"role": "system", "content": "You are kind."}, turns[0],
         {"role": "assistant", "content": "Hello Ada."},
         {"role": "user", "content": "What is my name?"}],
        max_tokens=10, temperature=0,
    )  # fmt: skip
    assert _text(message) == expected.text


@pytest.mark.real_model
def test_system_messages_among_the_turns(client: anthropic.Anthropic, reference: Llama) -> None:
    """SDK 2.x types ``{"role": "system"}`` messages: each is a system message where it
    stands (they were a 400)."""
    turns: list[Any] = [
        {"role": "system", "content": "You are kind."},
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."},
        {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
        {"role": "user", "content": "What is my name?"},
    ]
    message = client.messages.create(model="gemma", max_tokens=10, messages=turns,
                                     extra_body=GREEDY)  # fmt: skip
    flat = [{**t, "content": t["content"] if isinstance(t["content"], str)
             else t["content"][0]["text"]} for t in turns]  # fmt: skip
    assert _text(message) == reference.create_chat_completion(flat, max_tokens=10,
                                                              temperature=0).text  # fmt: skip
    counted = client.messages.count_tokens(model="gemma", messages=turns)
    assert counted.input_tokens == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0
    )
    image: Any = {"role": "system", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}  # fmt: skip
    with pytest.raises(anthropic.BadRequestError, match="text blocks only"):
        client.messages.create(model="gemma", max_tokens=4, messages=[image, *turns[1:]])


@pytest.mark.real_model
def test_a_stream_and_its_final_message(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="gemma", max_tokens=16, messages=COUNT,
                                   extra_body=GREEDY)  # fmt: skip
    with client.messages.stream(model="gemma", max_tokens=16, messages=COUNT,
                                extra_body=GREEDY) as stream:  # fmt: skip
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == _text(whole) == _text(final)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16
    assert final.id.startswith("msg_")
    total = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert total == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


@pytest.mark.real_model
def test_the_stream_speaks_anthropics_events(server: LiveServer) -> None:
    body = {"model": "gemma", "max_tokens": 4, "stream": True, "messages": COUNT, **GREEDY}
    response = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY,
                          "anthropic-version": "2023-06-01"})  # fmt: skip
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [block.split("\n") for block in response.text.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    payloads = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert [p["type"] for p in payloads] == names
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert payloads[0]["message"]["usage"]["input_tokens"] > 0
    assert payloads[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert payloads[-2]["usage"]["output_tokens"] == 4
    # Asked again, most of the prompt is reused: the start says so as the end does (it
    # counted the whole prompt as uncached before).
    again = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY})
    events = [block.split("\n") for block in again.text.strip().split("\n\n")]
    start, end = (json.loads(events[i][1].removeprefix("data: ")) for i in (0, -2))
    split = ("input_tokens", "cache_read_input_tokens")
    assert [start["message"]["usage"][k] for k in split] == [end["usage"][k] for k in split]
    assert start["message"]["usage"]["cache_read_input_tokens"] > 0


@pytest.mark.real_model
def test_an_assistant_prefill_is_continued(client: anthropic.Anthropic, reference: Llama) -> None:
    prefill = "One, two,"
    message = client.messages.create(
        model="gemma", max_tokens=8, extra_body=GREEDY,
        messages=[*COUNT, {"role": "assistant", "content": prefill}],
    )  # fmt: skip
    prompt = reference.chat_prompt(COUNT) + prefill
    expected = reference.create_completion(reference.tokenize(prompt, False, True),
                                           max_tokens=8, temperature=0)  # fmt: skip
    assert _text(message) == expected.text and expected.text.startswith(" three")
    with client.messages.stream(
        model="gemma", max_tokens=8, extra_body=GREEDY,
        messages=[*COUNT, {"role": "assistant", "content": prefill}],
    ) as stream:  # fmt: skip
        assert "".join(stream.text_stream) == expected.text


@pytest.mark.real_model
def test_a_stop_sequence_ends_the_answer(client: anthropic.Anthropic) -> None:
    free = _text(client.messages.create(model="gemma", max_tokens=24, messages=COUNT,
                                        extra_body=GREEDY))  # fmt: skip
    stop = free.split()[2]  # a word the greedy answer is known to reach
    message = client.messages.create(model="gemma", max_tokens=24, messages=COUNT,
                                     stop_sequences=[stop], extra_body=GREEDY)  # fmt: skip
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert _text(message) == free[: free.index(stop)]


@pytest.mark.real_model
def test_several_stop_sequences_name_the_one_that_matched(client: anthropic.Anthropic) -> None:
    free = _text(client.messages.create(model="gemma", max_tokens=24, messages=COUNT,
                                        extra_body=GREEDY))  # fmt: skip
    words = free.split()
    first, later = words[2], words[4]
    assert free.index(first) < free.index(later)
    stops = [later, "a stop never reached", first]  # the one reached is listed last
    message = client.messages.create(model="gemma", max_tokens=24, messages=COUNT,
                                     stop_sequences=stops, extra_body=GREEDY)  # fmt: skip
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == first
    assert _text(message) == free[: free.index(first)]
    with client.messages.stream(model="gemma", max_tokens=24, messages=COUNT,
                                stop_sequences=stops, extra_body=GREEDY) as stream:  # fmt: skip
        assert "".join(stream.text_stream) == _text(message)
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == first


@pytest.mark.real_model
def test_count_tokens_matches_the_usage(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model="gemma", messages=COUNT, system="Be brief.",
                                           tools=[WEATHER])  # fmt: skip
    message = client.messages.create(model="gemma", max_tokens=1, messages=COUNT,
                                     system="Be brief.", tools=[WEATHER],
                                     extra_body=GREEDY)  # fmt: skip
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    shorter = client.messages.count_tokens(model="gemma", messages=COUNT)
    assert 0 < shorter.input_tokens < counted.input_tokens


@pytest.mark.real_model
def test_counts_follow_the_chat_api_where_a_template_cannot_present_tools(
    gemma_path: Path,
) -> None:
    # Gemma 3's own template has no place for tools: the chat API describes them in a system
    # turn (llama.cpp's generic format), or leaves them out for "none"; the counts were the
    # template's rendering, without the description.
    with _own_server(gemma_path, n_ctx=2048, max_tokens_limit=64) as live:
        plain = anthropic.Anthropic(base_url=live.url, api_key="-", max_retries=0)
        counts = []
        for choice in ({"type": "auto"}, {"type": "none"}):
            ask: Any = {"model": "gemma", "messages": COUNT, "tools": [WEATHER],
                        "tool_choice": choice}  # fmt: skip
            counted = plain.messages.count_tokens(**ask).input_tokens
            with plain.messages.stream(max_tokens=2, extra_body=GREEDY, **ask) as stream:
                start = next(iter(stream)).message.usage  # type: ignore[union-attr]
                final = stream.get_final_message().usage
            # The start splits the prompt as the end does: uncached input and cache reads.
            opened = start.input_tokens + (start.cache_read_input_tokens or 0)
            assert counted == opened == final.input_tokens + (final.cache_read_input_tokens or 0)
            counts.append(counted)
        alone = plain.messages.count_tokens(model="gemma", messages=COUNT).input_tokens
        assert counts[1] == alone < counts[0]


@contextmanager
def _own_server(gemma_path: Path, n_ctx: int, max_tokens_limit: int) -> Iterator[LiveServer]:
    """A server of its own, one slot, no key: for settings the module's server does not have."""
    settings = ServerSettings(model=str(gemma_path), model_alias="gemma", n_ctx=n_ctx,
                              n_threads=2, max_tokens_limit=max_tokens_limit)  # fmt: skip
    live = LiveServer(settings)
    try:
        assert live.wait_until_loaded() == 200
        yield live
    finally:
        live.close()


@pytest.mark.real_model
def test_an_output_format_constrains_the_answer(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}  # fmt: skip
    message = client.messages.create(
        model="gemma", max_tokens=32,
        messages=[{"role": "user", "content": "Pick a colour, as JSON."}],
        extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema",
                                                           "schema": schema}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(_text(message)), schema)


# -- tools ---------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_a_tool_round_trip(client: anthropic.Anthropic) -> None:
    question: Any = {"role": "user", "content": "What is the weather in Paris?"}
    call = client.messages.create(
        model="gemma", max_tokens=64, messages=[question], tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY,
    )  # fmt: skip
    assert call.stop_reason == "tool_use"
    uses = [b for b in call.content if isinstance(b, ToolUseBlock)]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert uses[0].input["city"] in ("Paris", "Lisbon")
    assert uses[0].id.startswith("toolu_")
    with client.messages.stream(
        model="gemma", max_tokens=64, messages=[question], tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY,
    ) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if isinstance(b, ToolUseBlock)] == [
        (uses[0].name, uses[0].input)
    ]
    result: Any = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 24 degrees."},
    ]}  # fmt: skip
    answer = client.messages.create(
        model="gemma", max_tokens=16, tools=[WEATHER],
        messages=[question, {"role": "assistant", "content": call.content}, result],
        tool_choice={"type": "none"}, extra_body=GREEDY,
    )  # fmt: skip
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and _text(answer)


@pytest.mark.real_model
def test_the_sdks_tool_runner_goes_on_without_a_thread(
    client: anthropic.Anthropic, server: LiveServer
) -> None:
    # The runner asks for a server-side thread first and, told in the error's details that
    # the server cannot thread, sends the conversation again without one (a 400 before).
    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "Sunny, 24 degrees."

    runner = client.beta.messages.tool_runner(
        model="gemma", max_tokens=48, tools=[get_weather], max_iterations=2,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        extra_body=GREEDY,
    )  # fmt: skip
    replies = list(runner)
    assert replies and all(reply.role == "assistant" for reply in replies)
    threaded = _post(server, {"model": "gemma", "max_tokens": 4, "thread": {"type": "create"},
                              "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert threaded.status_code == 400
    assert threaded.json()["error"]["details"] == {
        "error_code": "thread_unsupported_request", "unsupported": ["thread"]
    }  # fmt: skip


@pytest.mark.real_model
def test_a_full_context_is_not_reported_as_the_token_budget(client: anthropic.Anthropic) -> None:
    # A slot holds 1,024 tokens: a long prompt leaves room for fewer than max_tokens. Told
    # "max_tokens", a client would ask again with a larger budget, and fail the same way.
    long: Any = [{"role": "user", "content": "word " * 980}]
    whole = client.messages.create(model="gemma", max_tokens=200, messages=long,
                                   extra_body=GREEDY)  # fmt: skip
    assert whole.usage.output_tokens < 200
    assert whole.stop_reason == "model_context_window_exceeded"
    with client.messages.stream(model="gemma", max_tokens=200, messages=long,
                                extra_body=GREEDY) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "model_context_window_exceeded"
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    short = client.messages.create(model="gemma", max_tokens=3, messages=long, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


# -- keys and refusals ---------------------------------------------------------------------------


def _post(server: LiveServer, body: dict[str, Any], key: str = KEY) -> httpx.Response:
    return httpx.post(server.url + "/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"})  # fmt: skip


@pytest.mark.real_model
def test_keys_in_either_header_and_anthropics_error_shape(server: LiveServer) -> None:
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="gemma", max_tokens=1, messages=COUNT)
    error: Any = caught.value.body
    assert caught.value.status_code == 401 and error["type"] == "error"
    assert error["error"]["type"] == "authentication_error" and "x-api-key" in str(error)
    bearer = httpx.post(server.url + "/v1/messages/count_tokens",
                        json={"model": "gemma", "messages": COUNT},
                        headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    openai_route = httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY})
    assert openai_route.status_code == 200
    refused = httpx.get(server.url + "/v1/models", headers={"x-api-key": "wrong"})
    assert refused.status_code == 401 and "message" in refused.json()["error"]  # OpenAI's shape


@pytest.mark.real_model
def test_both_sdks_list_and_retrieve_the_model(
    server: LiveServer, client: anthropic.Anthropic
) -> None:
    """One /v1/models answers OpenAI's and Anthropic's ``models`` (whose ModelInfo needs
    created_at, display_name, lifecycle and type); /v1/models/{id} retrieves a listed one."""
    listed = client.models.list()
    assert [m.id for m in listed.data] == ["gemma"] and listed.has_more is False
    card = httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).json()["data"][0]
    assert anthropic.types.ModelInfo.model_validate(card).display_name == "gemma"
    assert openai.types.Model.model_validate(card).created == card["created"]
    assert client.models.retrieve("gemma").created_at.timestamp() == card["created"]
    opened = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert opened.models.retrieve("gemma").id == "gemma"
    with pytest.raises(openai.NotFoundError, match="lists one, 'gemma'"):
        opened.models.retrieve("gpt-4o")
    # Unknown routes and methods answer in the shape of the API their path belongs to.
    batches = httpx.get(server.url + "/v1/messages/batches", headers={"x-api-key": KEY})
    assert batches.status_code in (404, 405) and batches.json()["type"] == "error"
    wrong_method = httpx.get(server.url + "/v1/chat/completions", headers={"x-api-key": KEY})
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"


PDF: Any = {
    "type": "document",
    "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
}
URL_IMAGE: Any = {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}
PREFILL: Any = [*COUNT, {"role": "assistant", "content": "{"}]


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
        ({"messages": [{"role": "user", "content": [PDF]}]}, "document source of type 'base64'"),
        ({"messages": [{"role": "user", "content": [URL_IMAGE]}]}, "url"),
        ({"messages": PREFILL, "tools": [WEATHER]}, "prefill"),
        ({"messages": [{"role": "assistant", "content": "x"}] * 2}, "need a user message"),
        ({"tools": [{"name": "shout", "input_schema": {"type": "string"}}]}, "'object'"),
        ({"max_tokens": None}, "max_tokens"),
    ],
)
def test_what_is_refused_is_named(server: LiveServer, extra: dict[str, Any], named: str) -> None:
    body = {"model": "gemma", "max_tokens": 4, "messages": COUNT, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    response = _post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]


@pytest.mark.real_model
def test_the_sdk_raises_on_a_refusal(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        client.messages.create(model="gemma", max_tokens=4, messages=COUNT,
                               thinking={"type": "enabled", "budget_tokens": 2048})  # fmt: skip


@pytest.mark.real_model
def test_plain_text_documents_and_null_fields_are_read(
    server: LiveServer, client: anthropic.Anthropic
) -> None:
    # A document with a text source was refused as an unknown block; "stream": null was a 400.
    text = "The sky is blue."
    source = {"type": "text", "media_type": "text/plain", "data": text}
    document: Any = {"type": "document", "title": "Notes", "source": source}
    as_text: Any = {"type": "text", "text": "Notes\n\n" + text}
    counts = [client.messages.count_tokens(model="gemma", messages=[
        {"role": "user", "content": [block, {"type": "text", "text": "What colour is it?"}]}
    ]).input_tokens for block in (document, as_text)]  # fmt: skip
    assert counts[0] == counts[1] > 10
    answer = _post(server, {"model": "gemma", "max_tokens": 2, "messages": COUNT, "stream": None,
                            "temperature": None, "stop_sequences": None})  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert answer.json()["type"] == "message" and answer.json()["usage"]["output_tokens"] == 2


@pytest.mark.real_model
def test_a_max_tokens_past_the_servers_limit_is_cut_to_it(gemma_path: Path) -> None:
    # Anthropic clients send 8,192 to 32,000: it was a 400 past --max-tokens-limit. An answer
    # cut at the limit stops for max_tokens, not for a full context.
    with _own_server(gemma_path, n_ctx=1024, max_tokens_limit=6) as live:
        plain = anthropic.Anthropic(base_url=live.url, api_key="-", max_retries=0)
        # (The SDK asks for a stream past ~21,000 tokens.)
        message = plain.messages.create(model="gemma", max_tokens=16_000, messages=COUNT,
                                        extra_body=GREEDY)  # fmt: skip
        assert (message.usage.output_tokens, message.stop_reason) == (6, "max_tokens")
        with plain.messages.stream(model="gemma", max_tokens=32_000, messages=COUNT,
                                   extra_body=GREEDY) as stream:  # fmt: skip
            final = stream.get_final_message()
        assert (final.usage.output_tokens, final.stop_reason) == (6, "max_tokens")
        opened = openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0)
        response = opened.responses.create(model="gemma", input="Count to ten.",
                                           max_output_tokens=32_000, temperature=0)  # fmt: skip
        assert response.status == "incomplete" and response.usage is not None
        assert response.usage.output_tokens == 6


# -- images --------------------------------------------------------------------------------------


def test_base64_images_in_chats_prefills_and_counts(tmp_path: Path) -> None:
    text = tiny.write_tiny_llama(tmp_path / "text.gguf", chat_templates={"": TEMPLATE})
    vision = mmproj.write_tiny_vision_mmproj(tmp_path / "vision.gguf")
    settings = ServerSettings(model=str(text), mmproj=str(vision), n_ctx=1024, max_media=2)
    server = LiveServer(settings)
    try:
        assert server.wait_until_loaded() == 200
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        data = base64.b64encode(encoded(PIXELS, "PNG")).decode()
        source = {"type": "base64", "media_type": "image/png", "data": data}
        image: Any = {"type": "image", "source": source}
        look: Any = {"role": "user", "content": [{"type": "text", "text": "see"}, image]}
        message = client.messages.create(model="text.gguf", max_tokens=4, messages=[look])
        seen = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
        counted = client.messages.count_tokens(model="text.gguf", messages=[look])
        assert counted.input_tokens == seen > IMAGE_TOKENS
        prefill: Any = {"role": "assistant", "content": "It shows"}
        continued = client.messages.create(model="text.gguf", max_tokens=4,
                                           messages=[look, prefill])  # fmt: skip
        usage = continued.usage
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) > seen
        for content, words in [([image] * 3, "more than 2"),
                               ([{**image, "source": {**source, "data": "!!"}}],
                                "base64")]:  # fmt: skip
            asked = {"role": "user", "content": content}
            for turns in ([asked], [asked, prefill]):  # the chat API, and a rendered prefill
                response = _post(server, {"model": "text.gguf", "max_tokens": 2,
                                          "messages": turns})  # fmt: skip
                assert response.status_code == 400, response.text
                assert words in response.json()["error"]["message"]
    finally:
        server.close()
