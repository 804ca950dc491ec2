"""The server driven the way llama-server's clients drive it: any model name, tools on a model
whose template cannot present them, bad chat templates at start, per-slot context, CORS
preflights, embeddings inputs, OpenAI's stream shape, and llama-server's metric names."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from live_server import LiveServer, running
from test_tool_calls import WEATHER

from llamacrab import InvalidParameterError, Llama
from llamacrab._types import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessage,
    ToolCall,
    Usage,
)
from llamacrab.cli import main as cli_main
from llamacrab.server import ServerSettings
from llamacrab.server import _wire as wire

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
bert = load_repo_module("scripts/convert_bert.py")


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tiny.write_tiny_llama(tmp_path_factory.mktemp("compat") / "tiny.gguf")
    return path


@pytest.fixture(scope="module")
def gemma_server(gemma_path: Path) -> Iterator[LiveServer]:
    settings = ServerSettings(model=str(gemma_path), model_alias="gemma", parallel=2,
                              n_ctx=2 * 2048, n_threads=2)  # fmt: skip
    yield from running(settings)


# -- model names ---------------------------------------------------------------------------------


def test_a_server_of_one_model_answers_for_any_model_name(tiny_path: Path) -> None:
    for server in running(ServerSettings(model=str(tiny_path), n_ctx=256)):
        for name in ("gpt-3.5-turbo", "tiny.gguf", "anything/at-all"):
            answer = httpx.post(server.url + "/v1/completions",
                                json={"model": name, "prompt": "hi", "max_tokens": 2})  # fmt: skip
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "tiny.gguf"  # the name it serves


# -- tools on a template that cannot present them ------------------------------------------------


@pytest.mark.real_model
def test_tools_on_gemma_use_the_generic_format(gemma_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=gemma_server.url + "/v1", api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = client.chat.completions.create(model="gpt-4o", messages=messages, tools=[WEATHER],  # type: ignore[list-item]
                                            tool_choice="required", max_tokens=80,
                                            temperature=0)  # fmt: skip
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Lisbon")  # type: ignore[union-attr]
    # Raw JSON: a whole answer's calls carry no "index" (only streamed deltas do).
    raw = httpx.post(gemma_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 80,
        "temperature": 0}).json()  # fmt: skip
    assert set(raw["choices"][0]["message"]["tool_calls"][0]) == {"id", "type", "function"}
    auto = client.chat.completions.create(model="gpt-4o", messages=messages, tools=[WEATHER],  # type: ignore[list-item]
                                          max_tokens=80, temperature=0)  # fmt: skip
    message = auto.choices[0].message
    assert message.tool_calls or (message.content and not message.content.startswith("{"))
    # The calls and results of a round trip are shown to the model as JSON.
    follow_up = [*messages, {"role": "assistant", "content": None,
                             "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24C"}]  # fmt: skip
    final = client.chat.completions.create(
        model="gpt-4o", messages=follow_up, tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none", max_tokens=16, temperature=0,
    )  # fmt: skip
    assert final.choices[0].message.content


@pytest.mark.real_model
def test_deprecated_function_calling(gemma_server: LiveServer) -> None:
    """``functions`` and ``function_call`` (still typed by the SDK) were ignored: the model
    answered in text. They are one tool call at most, answered as ``function_call``."""
    client = openai.OpenAI(base_url=gemma_server.url + "/v1", api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    function: Any = WEATHER["function"]
    forced: Any = {"name": "get_weather"}
    result = client.chat.completions.create(model="m", messages=messages, functions=[function],
                                            function_call=forced, max_tokens=80,
                                            temperature=0)  # fmt: skip
    choice = result.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    call = choice.message.function_call
    assert call is not None and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Lisbon")
    stream = client.chat.completions.create(model="m", messages=messages, functions=[function],
                                            function_call=forced, max_tokens=80, temperature=0,
                                            stream=True)  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    streamed = [c.delta.function_call for c in chunks if c.delta.function_call]
    assert [(f.name, f.arguments) for f in streamed] == [(call.name, call.arguments)]
    assert chunks[-1].finish_reason == "function_call"
    # The old round trip: the assistant's function_call, then a "function" message.
    follow_up = [*messages, {"role": "assistant", "content": None,
                             "function_call": {"name": call.name, "arguments": call.arguments}},
                 {"role": "function", "name": "get_weather", "content": "Sunny, 24C"}]  # fmt: skip
    final = client.chat.completions.create(model="m", messages=follow_up, functions=[function],
                                           function_call="none", max_tokens=8)  # fmt: skip
    assert final.choices[0].message.content and final.choices[0].finish_reason != "function_call"
    for bad, words in (({"functions": [function], "tools": [WEATHER]}, "not both"),
                       ({"messages": [{"role": "function", "name": "f", "content": "x"}]},
                        "without an assistant function_call")):  # fmt: skip
        body = {"messages": messages, "max_tokens": 2, **bad}
        refused = httpx.post(gemma_server.url + "/v1/chat/completions", json=body)
        assert refused.status_code == 400 and words in refused.json()["error"]["message"]


def test_parallel_tool_calls_false_answers_the_first_call() -> None:
    """Chat's parallel_tool_calls false (a template with native calls can answer several):
    whole and streamed, as /v1/responses and Anthropic's disable_parallel_tool_use do."""
    calls = (ToolCall("a", "{}", "call_1"), ToolCall("b", "{}", "call_2"))
    message = ChatMessage("assistant", None, calls)
    result = ChatCompletion("chatcmpl-1", 0, "m", (ChatChoice(0, message, "tool_calls"),),
                            Usage(3, 4))  # fmt: skip
    chunk = ChatCompletionChunk("chatcmpl-1", 0, "m", 0, ChatDelta(None, "", calls), "tool_calls")

    def names(parallel: bool) -> tuple[list[str], list[str]]:
        whole = wire.chat_completion(result, "m", parallel)["choices"][0]["message"]
        streamed = [c for e in wire.chat_chunk(chunk, "m", parallel)
                    for c in e["choices"][0]["delta"].get("tool_calls", [])]  # fmt: skip
        return [c["function"]["name"] for c in whole["tool_calls"]], [
            c["function"]["name"] for c in streamed
        ]

    assert names(True) == (["a", "b"], ["a", "b"]) and names(False) == (["a"], ["a"])


# -- what fails at start, what does not ----------------------------------------------------------


def test_an_unknown_chat_template_fails_at_start(
    tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(InvalidParameterError, match=r"unknown --chat-template 'nope'.*chatml"):
        ServerSettings(model="m.gguf", chat_template="nope")
    for fine in ("chatml", "gemma", "{{ messages[0].content }}", "tokenizer.chat_template.x"):
        ServerSettings(model="m.gguf", chat_template=fine)
    assert cli_main(["serve", "m.gguf", "--chat-template", "nope"]) == 1
    assert "unknown --chat-template" in capsys.readouterr().err
    # A variant the model lacks, or a Jinja template that does not parse, fails the load.
    for template, words in (("tokenizer.chat_template.missing", "has no"),
                            ("{% if %}", "does not parse")):  # fmt: skip
        server = LiveServer(ServerSettings(model=str(tiny_path), chat_template=template))
        try:
            assert server.wait_until_loaded() == 503
            error = httpx.get(server.url + "/health").json()["error"]
            assert "does not work with this model" in error and words in error, error
        finally:
            server.close()


def test_the_per_slot_context_is_checked_against_the_training_length(
    tiny_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The tiny model was trained for 2048 tokens: two slots of 2048 are within it.
    settings = ServerSettings(model=str(tiny_path), n_ctx=4096, parallel=2, n_threads=2)
    for server in running(settings):
        answer = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200
    # One sequence of 4096 goes past it: llama.cpp warns, and so nothing refuses it.
    with (
        caplog.at_level(logging.WARNING, logger="llamacrab"),
        Llama(tiny_path, n_ctx=4096, n_threads=2) as llm,
    ):
        assert llm.context.n_ctx_seq == 4096
    assert "n_ctx_seq (4096) > n_ctx_train (2048)" in caplog.text


# -- CORS ----------------------------------------------------------------------------------------


def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})  # fmt: skip


def test_cors_preflights_need_no_key_and_other_origins_get_no_cors_headers(
    tiny_path: Path,
) -> None:
    settings = ServerSettings(model=str(tiny_path), n_ctx=256, api_keys=("k",),
                              cors_origins=("https://app.example",),
                              cors_origin_regex=r"http://localhost(:\d+)?")  # fmt: skip
    for server in running(settings):
        for origin in ("https://app.example", "http://localhost:5173", "http://localhost"):
            allowed = _preflight(server.url, origin)
            assert allowed.status_code == 200
            assert allowed.headers["access-control-allow-origin"] == origin
            assert "authorization" in allowed.headers["access-control-allow-headers"]
        for origin in ("https://evil.example", "http://localhost.evil.example"):
            other = _preflight(server.url, origin)
            assert other.status_code == 204 and "access-control-allow-origin" not in other.headers
        key = {"Authorization": "Bearer k"}
        plain = httpx.get(server.url + "/v1/models", headers={**key, "Origin": "https://x.example"})
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
        ok = httpx.get(server.url + "/v1/models", headers={**key, "Origin": "https://app.example"})
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        # A refusal still carries the CORS headers, so the page can read why.
        refused = httpx.get(server.url + "/v1/models", headers={"Origin": "https://app.example"})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == "https://app.example"
    # CORS off, an API key set: a preflight is answered, without CORS headers, not with 401.
    for server in running(ServerSettings(model=str(tiny_path), n_ctx=256, api_keys=("k",))):
        off = _preflight(server.url, "https://app.example")
        assert off.status_code == 204 and "access-control-allow-origin" not in off.headers
    with pytest.raises(InvalidParameterError, match="does not compile"):
        ServerSettings(model="m.gguf", cors_origin_regex="(")


# -- embeddings and reranking --------------------------------------------------------------------


def test_embeddings_inputs_and_a_model_that_does_not_pool() -> None:
    path = bert.minilm()
    texts = ["A cat sits on the mat.", "Stock markets fell today."]
    with Llama(path, embeddings=True, n_threads=2) as reference:
        expected = reference.embed(texts)
        ids = [reference.tokenize(t) for t in texts]
    for server in running(ServerSettings(model=str(path), embeddings=True, n_threads=2)):
        url = server.url + "/v1/embeddings"
        for given, rows in ((ids, [0, 1]), (ids[1], [1])):
            body = {"model": "text-embedding-3-small", "input": given}
            answer = httpx.post(url, json=body)
            assert answer.status_code == 200, answer.text
            vectors = np.array([d["embedding"] for d in answer.json()["data"]])
            assert np.allclose(vectors, expected[rows], atol=1e-6)
        assert answer.json()["usage"]["prompt_tokens"] == len(ids[1])
        for empty in ([], [[]], [ids[0], []]):
            refused = httpx.post(url, json={"input": empty})
            assert refused.status_code == 400 and "empty" in refused.json()["error"]["message"]
        outside = httpx.post(url, json={"input": [[10**7]]})
        assert outside.status_code == 400 and "vocabulary" in outside.json()["error"]["message"]
        metrics = httpx.get(server.url + "/metrics").text
        n_tokens = sum(len(t) for t in ids) + len(ids[1])
        assert f"llamacrab_prompt_tokens_total {n_tokens}" in metrics
        assert f"llamacpp:prompt_tokens_total {n_tokens}" in metrics
    unpooled = ServerSettings(model=str(path), embeddings=True, pooling="none", n_threads=2)
    for server in running(unpooled):
        answer = httpx.post(server.url + "/v1/embeddings", json={"input": texts})
        assert answer.status_code == 400 and "pooling" in answer.json()["error"]["message"]


def test_rerank_refuses_no_documents_and_takes_tei_bodies(tmp_path: Path) -> None:
    path = bert.write_tiny_reranker(tmp_path / "r.gguf")
    documents = ["alpha beta", "gamma", "beta beta alpha"]
    with Llama(path, embeddings=True, n_threads=2) as reference:
        expected = reference.rerank("alpha", documents)
    for server in running(ServerSettings(model=str(path), reranking=True, n_threads=2)):
        empty = httpx.post(server.url + "/v1/rerank", json={"query": "alpha", "documents": []})
        assert empty.status_code == 400 and "documents" in empty.json()["error"]["message"]
        body = {"query": "alpha", "texts": documents, "return_text": True}
        tei = httpx.post(server.url + "/rerank", json=body)
        assert tei.status_code == 200, tei.text
        results = tei.json()
        assert [r["index"] for r in results] == [e.index for e in expected]
        assert np.allclose([r["score"] for r in results], [e.score for e in expected], atol=1e-5)
        assert results[0]["text"] == expected[0].document
        assert "llamacpp:prompt_tokens_total 0" not in httpx.get(server.url + "/metrics").text


# -- OpenAI's shapes and llama-server's metrics --------------------------------------------------


@pytest.mark.real_model
def test_stream_chunks_fingerprints_and_metrics(gemma_server: LiveServer) -> None:
    url = gemma_server.url
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
            "temperature": 0}  # fmt: skip
    whole = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    fingerprint = whole["system_fingerprint"]
    assert fingerprint.startswith("llamacrab-")
    streamed = _events(httpx.post(url + "/v1/chat/completions", json={**body, "stream": True},
                                  timeout=60))  # fmt: skip
    first, last = streamed[0]["choices"][0], streamed[-1]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""} and first["finish_reason"] is None
    assert last["delta"] == {} and last["finish_reason"] == whole["choices"][0]["finish_reason"]
    middle = [e["choices"][0] for e in streamed[1:-1]]
    assert all(c["finish_reason"] is None and "role" not in c["delta"] for c in middle)
    text = "".join(c["delta"].get("content", "") for c in middle)
    assert text == whole["choices"][0]["message"]["content"]
    assert {e["system_fingerprint"] for e in streamed} == {fingerprint}
    usage = _events(httpx.post(url + "/v1/chat/completions", timeout=60, json={
        **body, "stream": True, "stream_options": {"include_usage": True}}))[-1]  # fmt: skip
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    completion = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert completion.json()["system_fingerprint"] == fingerprint
    metrics = httpx.get(url + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("llamacpp:")}  # fmt: skip
    assert values["llamacpp:tokens_predicted_total"] >= 6 + 6 + 6 + 2
    assert values["llamacpp:prompt_tokens_total"] > 0
    assert values["llamacpp:prompt_tokens_cached_total"] > 0  # the same prompt, again
    assert values["llamacpp:n_tokens_max"] > 6
    assert values["llamacpp:requests_processing"] == 0 == values["llamacpp:requests_deferred"]
    assert "# TYPE llamacpp:prompt_tokens_total counter" in metrics


@pytest.mark.parametrize("text", ["a\u2028b", "nel\x85", "p\u2029q", "plain"])
def test_events_survive_clients_that_split_lines_like_str_splitlines(text: str) -> None:
    # httpx's aiter_lines splits at U+0085/U+2028/U+2029 as well as CR/LF; the tiny model's
    # random tokens produce them, and a raw one cut a chat stream's JSON in half under load.
    from llamacrab.server import _anthropic_wire, _responses_events, _streaming

    payload = {"type": "delta", "text": text}
    frames = [_streaming.event(payload), _responses_events.frame(payload),
              _anthropic_wire.sse("delta", {"text": text})]  # fmt: skip
    for frame in frames:
        data = [line for line in frame.splitlines() if line.startswith("data: ")]
        assert len(data) == 1, frame
        assert json.loads(data[0][6:])["text"] == text
