"""Stop strings never leak, even partially, whatever the chunking of the text."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from llamacrab import InvalidParameterError, Llama
from llamacrab._engine.stop import StopMatcher
from llamacrab.compat import Llama as CompatLlama
from llamacrab.server import ServerSettings
from llamacrab.server._app import create_app


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        out.append(matcher.push(piece))
        if matcher.stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


@pytest.mark.parametrize("split", range(1, 8))
def test_stop_split_across_pieces_is_cut(split: int) -> None:
    text = "Hello world. END and more"
    pieces = [text[i : i + split] for i in range(0, len(text), split)]
    out, stopped = run(["END"], pieces)
    assert stopped and "".join(out) == "Hello world. "
    assert not any("E" in piece for piece in out)  # not even "E" of "END" was emitted early


def test_text_resembling_a_stop_is_released_when_it_diverges() -> None:
    out, stopped = run(["###"], ["a#", "#b", "c"])
    assert not stopped and "".join(out) == "a##bc"
    assert out[0] == "a"  # "#" held back while it could still start "###"


def test_earliest_of_several_stops_wins() -> None:
    out, stopped = run(["world", "lo w"], ["hello world"])
    assert stopped and out == ["hel"]


def test_no_stops_passes_everything_through() -> None:
    out, stopped = run([], ["a", "b"])
    assert out == ["a", "b", ""] and not stopped


def test_the_matched_stop_is_named() -> None:
    matcher = StopMatcher(["world", "lo w", "absent"])
    assert matcher.push("he") == "he" and matcher.matched is None
    assert matcher.push("llo world") == "l"
    assert matcher.stopped and matcher.matched == "lo w"  # the first in the text, not the list
    tie = StopMatcher(["ab", "a"])
    assert tie.push("xab") == "x" and tie.matched == "ab"  # same place: the first given


def _two_stops(text: str) -> tuple[str, str]:
    """A stop string the text reaches first and one it reaches only later."""
    first = text[2:5]
    at = text.find(first)
    later = next(text[j : j + 3] for j in range(at + 3, len(text) - 3)
                 if text.find(text[j : j + 3]) == j)  # fmt: skip
    return first, later


@pytest.mark.parametrize("parallel", [None, 2])
def test_a_completion_names_the_stop_string_that_ended_it(
    tiny_model_path: Path, parallel: int | None
) -> None:
    prompt = "the cat sat on the mat the dog sat on the cat"
    greedy: dict[str, Any] = {"max_tokens": 24, "min_tokens": 24, "temperature": 0}
    with Llama(tiny_model_path, n_ctx=256, n_threads=2, parallel=parallel) as llm:
        free = llm.create_completion(prompt, **greedy).text
        first, later = _two_stops(free)
        stops = [later, "never in it", first]  # listed last, found first
        result = llm.create_completion(prompt, stop=stops, **greedy).choices[0]
        assert result.text == free[: free.find(first)]
        assert result.finish_reason == "stop" and result.stop_sequence == first
        chunks = list(llm.stream_completion(prompt, stop=stops, **greedy))
        assert [c.stop_sequence for c in chunks] == [None] * (len(chunks) - 1) + [first]
        unstopped = llm.create_completion(prompt, stop=["never in it"], **greedy).choices[0]
        assert unstopped.finish_reason == "length" and unstopped.stop_sequence is None


def test_a_chat_completion_names_the_stop_string_that_ended_it(tiny_llama: Llama) -> None:
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    greedy: dict[str, Any] = {"max_tokens": 24, "min_tokens": 24, "temperature": 0,
                              "chat_format": "chatml"}  # fmt: skip
    free = tiny_llama.create_chat_completion(messages, **greedy).text
    first, later = _two_stops(free)
    answer = tiny_llama.create_chat_completion(messages, stop=[later, first], **greedy)
    assert answer.text == free[: free.find(first)]
    assert answer.choices[0].stop_sequence == first
    chunks = list(tiny_llama.stream_chat_completion(messages, stop=[later, first], **greedy))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_sequence == first
    assert all(c.stop_sequence is None for c in chunks[:-1])


EMPTY, SURROGATE = "empty stop string", "which UTF-8 cannot encode"
UNMATCHABLE = [("", EMPTY), (["x", ""], EMPTY), ("\ud800", SURROGATE), (["a\udc00b"], SURROGATE)]


def _drained(chunks: AsyncIterator[Any]) -> Callable[[], object]:
    async def drain() -> list[Any]:
        return [chunk async for chunk in chunks]

    return lambda: asyncio.run(drain())


@pytest.mark.parametrize(("stop", "why"), UNMATCHABLE)
def test_a_stop_string_that_cannot_match_is_refused(
    tiny_llama: Llama, tiny_model_path: Path, stop: str | list[str], why: str
) -> None:
    """An empty one was dropped (llamacrab.compat refused it), one with an unpaired surrogate
    accepted though no UTF-8 text holds one: both are refused wherever ``stop`` is taken."""
    messages = [{"role": "user", "content": "the cat"}]
    options: dict[str, Any] = {"stop": stop, "max_tokens": 2}
    chat = {**options, "chat_format": "chatml"}
    calls: dict[str, Callable[[], object]] = {
        "completion": lambda: tiny_llama.create_completion("the cat", **options),
        "stream": lambda: list(tiny_llama.stream_completion("the cat", **options)),
        "async": lambda: _drained(tiny_llama.astream_completion("the cat", **options))(),
        "chat": lambda: tiny_llama.create_chat_completion(messages, **chat),
        "chat stream": lambda: list(tiny_llama.stream_chat_completion(messages, **chat)),
        "async chat": lambda: _drained(tiny_llama.astream_chat_completion(messages, **chat))(),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidParameterError, match=why):
            call()
            pytest.fail(f"{name} took stop={stop!r}")
    with CompatLlama(str(tiny_model_path), n_ctx=64, chat_format="chatml", verbose=False) as compat:
        for call in (
            lambda: compat("the cat", **options),
            lambda: list(compat("the cat", stream=True, **options)),
            lambda: compat.create_chat_completion(messages, **options),
        ):
            with pytest.raises(InvalidParameterError, match=rf"stop=.*{why}"):
                call()
    # Still usable; greedy: the default sampling may draw an end token first (CI, 1 run).
    after = tiny_llama.create_completion("the cat", max_tokens=2, temperature=0)
    assert after.usage.completion_tokens == 2


def test_the_server_skips_an_empty_stop_string(tiny_model_path: Path) -> None:
    """As llama-server does: it cannot match before any text (the library refuses one, above;
    the server was a 400). The answers run to their length."""
    settings = ServerSettings(model=str(tiny_model_path))
    chat = {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 2,
            "ignore_eos": True}  # fmt: skip
    requests = [
        ("/v1/completions", {"prompt": "the cat", "max_tokens": 2, "stop": ["x", ""],
                             "ignore_eos": True}),
        ("/v1/chat/completions", {**chat, "stop": ""}),
        ("/completion", {"prompt": "the cat", "n_predict": 2, "stop": [""], "ignore_eos": True}),
    ]  # fmt: skip
    with (
        Llama(tiny_model_path, n_ctx=64, n_threads=2, chat_format="chatml") as llm,
        TestClient(create_app(settings, llm)) as client,
    ):
        for path, body in requests:
            answer = client.post(path, json=body)
            assert answer.status_code == 200, (path, answer.text)
            counted = answer.json().get("usage", {}).get("completion_tokens")
            assert (counted or answer.json().get("tokens_predicted")) == 2, (path, answer.text)
