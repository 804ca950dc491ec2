"""Streamed answers of several choices (OpenAI's ``n``, a legacy completion's prompts), and
the opening delta of a streamed tool-call answer, as OpenAI's SDK reads them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_server import LiveServer, running
from test_tool_calls import TEMPLATE, WEATHER

from llamacrab import Llama
from llamacrab._types import ChatCompletionChunk, ChatDelta
from llamacrab.server import ServerSettings
from llamacrab.server import _wire as wire

from support import Slow, load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
SAID: Any = [{"role": "user", "content": "hello there"}]
# Sampled (each choice its own seed): the choices differ, so a swapped index shows.
SAMPLED: dict[str, Any] = {"max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("choices") / "tiny-chat.gguf"
    path: Path = tiny.write_tiny_llama(out, chat_templates={"": TEMPLATE})
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["one-slot", "two-slots"])
def server(request: pytest.FixtureRequest, tiny_path: Path) -> Iterator[LiveServer]:
    # One slot runs the choices in turn, two side by side: each streams them.
    yield from running(ServerSettings(model=str(tiny_path), parallel=request.param,
                                      n_ctx=256 * request.param))  # fmt: skip


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _by_choice(events: list[dict[str, Any]], key: str) -> dict[int, str]:
    """Each choice's text (``key``: "text", or "content" of a chat delta), by index."""
    texts: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            piece = choice["delta"].get("content") if key == "content" else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    return texts


def _finishes(events: list[dict[str, Any]]) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for event in events:
        for choice in event["choices"]:
            if choice["finish_reason"] is not None:
                found.setdefault(choice["index"], []).append(choice["finish_reason"])
    return found


def test_chat_streams_n_choices_as_the_whole_answer_gives_them(server: LiveServer) -> None:
    body = {"messages": SAID, **SAMPLED}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    expected = {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert expected[0] != expected[1]  # else the test could not tell the choices apart
    events = _events(httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        **body, "stream": True, "stream_options": {"include_usage": True}}))  # fmt: skip
    assert _by_choice(events, "content") == expected
    finishes = {c["index"]: [c["finish_reason"]] for c in whole["choices"]}
    assert _finishes(events) == finishes  # each choice ends once, with its own reason
    assert all(len(e["choices"]) == 1 for e in events[:-1])
    assert len({e["id"] for e in events}) == 1  # one answer
    usage = events[-1]
    assert usage["choices"] == []
    assert {k: usage["usage"][k] for k in ("prompt_tokens", "completion_tokens")} == {
        k: whole["usage"][k] for k in ("prompt_tokens", "completion_tokens")
    }  # the prompt once, the completions of both choices
    # OpenAI's SDK accumulates them, each choice where its index says (its final completion
    # refuses answers cut by max_tokens: its snapshot is the same answer).
    with _client(server).chat.completions.stream(
        model="m", messages=SAID, max_tokens=8, temperature=1.0, seed=7, n=2
    ) as stream:
        stream.until_done()
        final = stream.current_completion_snapshot
    assert [(c.index, c.message.content) for c in final.choices] == sorted(expected.items())


def test_completions_stream_n_choices_of_several_prompts(server: LiveServer) -> None:
    body = {"prompt": ["hello there", "once upon a time"], **SAMPLED}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    expected = {c["index"]: c["text"] for c in whole["choices"]}
    assert sorted(expected) == [0, 1, 2, 3] and len(set(expected.values())) > 2
    events = _events(httpx.post(server.url + "/v1/completions", timeout=60, json={
        **body, "stream": True, "stream_options": {"include_usage": True}}))  # fmt: skip
    assert _by_choice(events[:-1], "text") == expected  # prompt i's choice j at i * n + j
    assert {i: len(f) for i, f in _finishes(events).items()} == {0: 1, 1: 1, 2: 1, 3: 1}
    assert events[-1]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    # The SDK's stream of one prompt's two choices.
    streamed = _client(server).completions.create(
        model="m", prompt="hello there", max_tokens=8, temperature=1.0, seed=7, n=2, stream=True
    )
    texts = {0: "", 1: ""}
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {0: expected[0], 1: expected[1]}


def test_a_client_that_leaves_stops_every_choice(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llama = Llama(tiny_path, n_ctx=512, parallel=2)
    scheduler, slow = llama.scheduler, Slow(delay=0.05)
    assert scheduler is not None
    stream_completion = llama.stream_completion

    def slowed(*args: Any, **kwargs: Any) -> Any:
        return stream_completion(*args, custom_samplers=(slow,), **kwargs)

    monkeypatch.setattr(llama, "stream_completion", slowed)
    body = {"messages": SAID, "n": 2, "max_tokens": 200, "min_tokens": 200, "stream": True}
    try:
        for server in running_with(tiny_path, llama):
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as answer:
                assert answer.status_code == 200
                for line in answer.iter_lines():
                    if line.startswith("data: "):
                        break  # both choices are generating; leave mid-stream
            deadline = time.monotonic() + 5  # the answers would take 10 s
            while scheduler.busy_slots or scheduler.queue_depth:
                assert time.monotonic() < deadline, "a choice went on generating"
                time.sleep(0.02)
            assert slow.calls < 2 * 150
    finally:
        llama.close()


def running_with(tiny_path: Path, llama: Llama) -> Iterator[LiveServer]:
    server = LiveServer(ServerSettings(model=str(tiny_path)), llama)
    try:
        assert server.wait_until_loaded() == 200
        yield server
    finally:
        server.close()


def test_the_opening_delta_of_an_answer_that_may_be_tool_calls_has_null_content() -> None:
    opening = ChatCompletionChunk("chatcmpl-1", 0, "m", 0, ChatDelta("assistant", ""))
    text, calls = wire.chat_chunk(opening, "m"), wire.chat_chunk(opening, "m", calls=True)
    assert text[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # OpenAI's
    assert calls[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert wire.may_call_tools({"tools": [WEATHER]})
    assert not wire.may_call_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert not wire.may_call_tools({})


@pytest.mark.real_model
def test_the_sdk_accumulates_a_streamed_tool_call_answer_as_the_whole_one(
    gemma_path: Path,
) -> None:
    settings = ServerSettings(model=str(gemma_path), n_ctx=2048, n_threads=2)
    for server in running(settings):
        client = _client(server)
        asked: dict[str, Any] = {
            "model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], "tool_choice": "required", "max_tokens": 60, "temperature": 0,
            "logprobs": True,
        }  # fmt: skip
        whole = client.chat.completions.create(**asked).choices[0].message
        with client.chat.completions.stream(**asked) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_completion().choices[0].message
        assert whole.content is None and whole.tool_calls
        assert final.content is None and "content.delta" not in kinds
        assert final.tool_calls and final.tool_calls[0].function.name == "get_weather"
        assert final.tool_calls[0].function.arguments == whole.tool_calls[0].function.arguments
        # Two choices, each's calls in chunks of its own index.
        with client.chat.completions.stream(**{**asked, "n": 2}) as stream:
            calls = [(c.index, c.delta.tool_calls) for chunk in stream if chunk.type == "chunk"
                     for c in chunk.chunk.choices if c.delta.tool_calls]  # fmt: skip
            both = stream.get_final_completion().choices
        assert sorted(index for index, _ in calls) == [0, 1]
        for choice in both:
            assert choice.message.content is None and choice.message.tool_calls
            assert choice.message.tool_calls[0].function.name == "get_weather"
