"""The OpenAI-compatible server, live on loopback, driven by the openai SDK and raw HTTP."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from live_server import LiveServer
from test_tool_calls import TEMPLATE, WEATHER

from llamacrab import CustomSampler, InvalidParameterError, Llama
from llamacrab._engine.scheduler import Scheduler
from llamacrab.cli import main as cli_main
from llamacrab.server import ServerSettings, add_arguments, parse_settings, settings_from_args
from llamacrab.server._llama_kwargs import generation_kwargs

from support import Gate, Slow, load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
PROMPTS = [f"Tell me a fact about the number {i}." for i in range(8)]


def _running(settings: ServerSettings, llama: Llama | None = None) -> Iterator[LiveServer]:
    server = LiveServer(settings, llama)
    try:
        assert server.wait_until_loaded() == 200
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def gemma_server(gemma_path: Path) -> Iterator[LiveServer]:
    settings = ServerSettings(model=str(gemma_path), model_alias="gemma", parallel=8,
                              n_ctx=8 * 512, n_threads=2)  # fmt: skip
    yield from _running(settings)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("server") / "tiny-chat.gguf"
    path: Path = tiny.write_tiny_llama(out, chat_templates={"": TEMPLATE})
    return path


@pytest.fixture(scope="module")
def guarded_server(tiny_path: Path) -> Iterator[LiveServer]:
    """A tiny model behind an API key, with small limits."""
    settings = ServerSettings(model=str(tiny_path), api_keys=("sesame", "other"), n_ctx=256,
                              max_body_bytes=4096, max_tokens_limit=100, max_n=2)  # fmt: skip
    yield from _running(settings)


def sdk(server: LiveServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


# -- the openai SDK against Gemma ----------------------------------------------------------------


@pytest.mark.real_model
def test_completion_matches_the_python_api(gemma_server: LiveServer, gemma: Llama) -> None:
    prompt = "The three primary colours are"
    result = sdk(gemma_server).completions.create(model="gemma", prompt=prompt, max_tokens=12,
                                                  temperature=0)  # fmt: skip
    expected = gemma.create_completion(prompt, max_tokens=12, temperature=0)
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 12
    assert result.model == "gemma" and result.object == "text_completion"


@pytest.mark.real_model
def test_chat_and_its_stream_agree(gemma_server: LiveServer) -> None:
    client = sdk(gemma_server)
    messages = [{"role": "user", "content": "Name a large animal."}]
    # Once first, so that both compared below decode the same suffix after the same cached
    # prefix: greedy output can differ at near-ties between batch shapes (as in llama-server),
    # and what earlier tests left in the slots would decide it.
    for _ in range(2):
        whole = client.chat.completions.create(model="gemma", messages=messages,  # type: ignore[arg-type]
                                               max_tokens=16, temperature=0)  # fmt: skip
    stream = client.chat.completions.create(model="gemma", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    # llama-server's extra "timings", which its web UIs read: on the answer, and on the last
    # event of a stream (the usage event when asked for, else the one that finishes).
    assert whole.usage is not None
    for timed in (whole, chunks[-1]):
        timings = (timed.model_extra or {})["timings"]
        assert timings["predicted_n"] == whole.usage.completion_tokens and timings["prompt_ms"] > 0
    plain = list(client.chat.completions.create(model="gemma", messages=messages,  # type: ignore[arg-type]
                                                max_tokens=4, stream=True))  # fmt: skip
    assert [("timings" in (c.model_extra or {})) for c in plain] == [False] * (len(plain) - 1) + [
        True
    ]
    assert plain[-1].choices[0].finish_reason is not None


@pytest.mark.real_model
def test_chat_logprobs_in_openai_shape(gemma_server: LiveServer) -> None:
    client = sdk(gemma_server)
    messages = [{"role": "user", "content": "Say a colour."}]
    result = client.chat.completions.create(model="gemma", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=5, temperature=0, logprobs=True,
                                            top_logprobs=2)  # fmt: skip
    content = result.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    assert "".join(entry.token for entry in content) == result.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)  # greedy: the top one
    stream = client.chat.completions.create(model="gemma", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=5, temperature=0, logprobs=True,
                                            stream=True)  # fmt: skip
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in content]


@pytest.mark.real_model
def test_logprobs_give_each_tokens_own_bytes(gemma_server: LiveServer) -> None:
    """``bytes`` holds a token's own bytes (a byte-fallback token's one byte, not the escape
    its text shows), so joined they spell the answer."""
    client = sdk(gemma_server)
    emoji_bytes = {"478": 100, "397": 100, "408": 100, "381": 100}  # 0xf0 0x9f 0xaa 0x8f
    result = client.chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3, logit_bias=emoji_bytes,
    )  # fmt: skip
    content = result.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and all(len(e.bytes or []) == 1 for e in content)
    assert content[0].token == "\\xf0" and content[0].bytes == [0xF0]
    joined = b"".join(bytes(e.bytes or []) for e in content)
    assert joined.decode() == result.choices[0].message.content
    alternatives = [t for entry in content for t in entry.top_logprobs]
    assert len(alternatives) == 12
    assert all(bytes(t.bytes or []).decode(errors="backslashreplace") == t.token
               for t in alternatives)  # fmt: skip


@pytest.mark.real_model
def test_json_schema_response_format(gemma_server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    result = sdk(gemma_server).chat.completions.create(
        model="gemma", max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(result.choices[0].message.content or ""), schema)


@pytest.mark.real_model
def test_eight_concurrent_streams_equal_eight_sequential_runs(gemma_server: LiveServer) -> None:
    client = sdk(gemma_server)

    def stream(prompt: str) -> list[tuple[str, dict[str, float]]]:
        """(token, top-2 alternatives) per generated token."""
        chunks = client.completions.create(model="gemma", prompt=prompt, max_tokens=32,
                                           temperature=0, stream=True, logprobs=2)  # fmt: skip
        return [(c.choices[0].logprobs.tokens[0], c.choices[0].logprobs.top_logprobs[0])  # type: ignore[index, union-attr]
                for c in chunks if c.choices[0].logprobs]  # fmt: skip

    sequential = [stream(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent = list(pool.map(stream, PROMPTS))
    for alone, together in zip(sequential, concurrent, strict=True):
        assert len(alone) == len(together) == 32
        differ = next(
            (i for i, (a, b) in enumerate(zip(alone, together, strict=False)) if a[0] != b[0]), None
        )
        if differ is None:
            continue
        # llama.cpp's CPU kernels round differently by batch shape (llama-server alike): a
        # sequence's logits moved by up to ~1 (max over the vocabulary) between an 11-token
        # decode and an 88-token one, while other sequences' contents change nothing (see
        # test_parallel). That may only flip a decision the lone run made narrowly.
        top = sorted(alone[differ][1].values(), reverse=True)
        assert top[0] - top[1] < 0.5, f"diverged at token {differ} on a clear decision {top}"
    metrics = httpx.get(gemma_server.url + "/metrics").text
    assert "llamacrab_slots_total 8" in metrics and "llamacrab_slots_busy 0" in metrics


@pytest.mark.real_model
def test_tokenize_detokenize_metrics_and_openapi(gemma_server: LiveServer, gemma: Llama) -> None:
    url = gemma_server.url
    tokens = httpx.post(url + "/extras/tokenize", json={"input": "Hello world"}).json()["tokens"]
    assert tokens == gemma.tokenize("Hello world")
    count = httpx.post(url + "/extras/tokenize/count", json={"input": "Hello world"}).json()
    assert count == {"count": len(tokens)}
    text = httpx.post(url + "/extras/detokenize", json={"tokens": tokens[1:]}).json()["text"]
    assert text == "Hello world"
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "gemma"
    metrics = httpx.get(url + "/metrics").text
    assert 'llamacrab_requests_total{route="/extras/tokenize",status="200"}' in metrics
    assert "# TYPE llamacrab_queue_depth gauge" in metrics
    schema = httpx.get(url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/embeddings"} <= set(schema["paths"])
    assert "ChatCompletionRequest" in schema["components"]["schemas"]


# -- tools, embeddings, rerank -------------------------------------------------------------------


def test_a_forced_tool_call_through_the_sdk(guarded_server: LiveServer) -> None:
    client = sdk(guarded_server, "sesame")
    messages = [{"role": "user", "content": "weather?"}]
    result = client.chat.completions.create(model="tiny-chat.gguf", messages=messages,  # type: ignore[arg-type]
                                            tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
                                            max_tokens=100, seed=2)  # fmt: skip
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Lisbon")  # type: ignore[union-attr]
    stream = client.chat.completions.create(model="tiny-chat.gguf", messages=messages,  # type: ignore[arg-type]
                                            tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
                                            max_tokens=100, seed=2, stream=True)  # fmt: skip
    chunks = list(stream)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(t.index, t.function.name) for t in calls] == [(0, "get_weather")]  # type: ignore[union-attr]


def test_seed_minus_one_and_a_malformed_tool_choice(guarded_server: LiveServer) -> None:
    url, auth = guarded_server.url, {"authorization": "Bearer sesame"}
    messages = [{"role": "user", "content": "weather?"}]
    # llama-server's "a random seed", which its clients send: was a 400 (0..4294967295).
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": messages}),
    ):
        answer = httpx.post(url + path, json={**body, "seed": -1, "max_tokens": 2}, headers=auth)
        assert answer.status_code == 200, answer.text
    # OpenAI's seed is an int64 (clients draw 64-bit seeds): each value is one 32-bit seed.
    texts = set()
    for seed in (2**70, 2**63 - 1, -2, 5, 5 + 2**32 - 1):
        body = {"prompt": "hi", "seed": seed, "max_tokens": 8, "temperature": 1.0}
        answer = httpx.post(url + "/v1/completions", json=body, headers=auth)
        if seed == 2**70:
            assert answer.status_code == 400 and "seed" in answer.json()["error"]["message"]
            continue
        assert answer.status_code == 200, answer.text
        texts.add((seed % (2**32 - 1), answer.json()["choices"][0]["text"]))
    assert len({seed for seed, _ in texts}) == 3 and len(texts) == 3  # 5 and 5 + 2**32 - 1 agree
    # A tool_choice whose function is a name, not an object: a 400 naming the shape (was an
    # AttributeError from inside, a plain-text 500).
    tool = {"type": "function", "function": {"name": "get_weather"}}
    answer = httpx.post(url + "/v1/chat/completions", headers=auth, json={
        "messages": messages, "tools": [WEATHER], "max_tokens": 2,
        "tool_choice": {"type": "function", "function": "get_weather"}})  # fmt: skip
    assert answer.status_code == 400
    assert 'needs {"function": {"name": ...}}' in answer.json()["error"]["message"]
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [tool]}}
    body = {"messages": messages, "tools": [WEATHER], "max_tokens": 2, "tool_choice": allowed}
    answer = httpx.post(url + "/v1/chat/completions", headers=auth, json=body)
    assert answer.json()["error"]["message"] == "tool_choice type 'allowed_tools' is not supported"
    named = {"messages": messages, "tools": [WEATHER], "max_tokens": 2, "tool_choice": tool}
    answer = httpx.post(url + "/v1/chat/completions", headers=auth, json=named)
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("path", ["/extras/tokenize", "/extras/tokenize/count", "/tokenize"])
def test_a_long_tokenize_leaves_the_server_answering(tiny_path: Path, path: str) -> None:
    # Tokenizing is C work that can take seconds (llama.cpp's SPM byte fallback was quadratic:
    # 200k of one character took 2 s). /extras/tokenize ran it on the event loop, so every
    # other request waited. Here tokenize blocks until /health has answered.
    with Llama(tiny_path, n_ctx=256, n_threads=1) as llm:
        entered, release = threading.Event(), threading.Event()
        tokenize = llm.tokenize

        def held(*args: object, **kwargs: object) -> list[int]:
            entered.set()
            release.wait(30)
            return tokenize(*args, **kwargs)  # type: ignore[arg-type]

        llm.tokenize = held  # type: ignore[method-assign]
        server = LiveServer(ServerSettings(model=str(tiny_path), n_ctx=256), llm)
        try:
            with ThreadPoolExecutor(1) as pool:
                body = {"input": "hello", "content": "hello"}
                answer = pool.submit(httpx.post, server.url + path, json=body, timeout=60)
                assert entered.wait(30)
                assert httpx.get(server.url + "/health", timeout=5).status_code == 200
                release.set()
                assert answer.result().status_code == 200
        finally:
            release.set()
            server.close()


def test_embeddings_through_the_sdk(tmp_path: Path) -> None:
    path = load_repo_module("scripts/convert_bert.py").minilm()
    texts = ["A cat sits on the mat.", "Stock markets fell today."]
    with Llama(path, embeddings=True, n_threads=2) as reference:
        expected = reference.embed(texts)
        n_tokens = sum(len(reference.tokenize(t)) for t in texts)
    for server in _running(ServerSettings(model=str(path), embeddings=True, n_threads=2)):
        client = sdk(server)
        as_base64 = client.embeddings.create(model=path.name, input=texts)  # the SDK's default
        as_floats = client.embeddings.create(model=path.name, input=texts,
                                             encoding_format="float")  # fmt: skip
        for result in (as_base64, as_floats):
            vectors = np.array([d.embedding for d in result.data])
            assert np.allclose(vectors, expected, atol=1e-6)
        assert as_floats.usage.prompt_tokens == n_tokens
        # The model's own width may be named (LangChain and LlamaIndex send it); any other
        # is refused naming the width. Every value was a 400.
        width = len(expected[0])
        full = client.embeddings.create(model=path.name, input=texts, dimensions=width)
        assert np.allclose([d.embedding for d in full.data], expected, atol=1e-6)
        with pytest.raises(openai.BadRequestError, match=f"have {width} dimensions"):
            client.embeddings.create(model=path.name, input=texts, dimensions=width // 2)
        for empty, named in (
            ("", "input 0 is an empty text"),
            (["a", ""], "input 1 is an empty"),
            ([[1], []], "input 1 is an empty list"),
            ([], "input is empty"),
        ):
            with pytest.raises(openai.BadRequestError, match=named):  # as OpenAI: not a lone BOS
                client.embeddings.create(model=path.name, input=empty)  # type: ignore[arg-type]
        chat = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
        assert chat.status_code == 400 and "embeddings" in chat.json()["error"]["message"]


def test_rerank_and_its_aliases(tmp_path: Path) -> None:
    path = load_repo_module("scripts/convert_bert.py").write_tiny_reranker(tmp_path / "r.gguf")
    documents = ["alpha beta", "gamma", "beta beta alpha"]
    with Llama(path, embeddings=True, n_threads=2) as reference:
        expected = reference.rerank("alpha", documents)
    for server in _running(ServerSettings(model=str(path), reranking=True, n_threads=2)):
        for route in ("/v1/rerank", "/v1/reranking", "/rerank", "/reranking"):
            body = httpx.post(server.url + route, json={"query": "alpha", "documents": documents})
            results = body.json()["results"]
            assert [r["index"] for r in results] == [e.index for e in expected]
            assert np.allclose([r["relevance_score"] for r in results],
                               [e.score for e in expected], atol=1e-5)  # fmt: skip
            assert results[0]["document"] == {"text": expected[0].document}
        top = httpx.post(server.url + "/v1/rerank",
                         json={"query": "alpha", "documents": documents, "top_n": 1})  # fmt: skip
        assert len(top.json()["results"]) == 1


# -- concurrency: disconnects, queue ---------------------------------------------------------------


@pytest.mark.real_model
def test_a_client_that_leaves_frees_its_slot(gemma_path: Path) -> None:
    settings = ServerSettings(model=str(gemma_path), n_ctx=4096, n_threads=2)  # one slot
    for server in _running(settings):
        body = {"prompt": "Count from one to a thousand:", "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # the generation is running; leave mid-stream
        started = time.perf_counter()
        follow = httpx.post(server.url + "/v1/completions", timeout=60,
                            json={"prompt": "Hi", "max_tokens": 4})  # fmt: skip
        assert follow.status_code == 200
        assert time.perf_counter() - started < 20  # not the ~100 s the first stream would take
        assert "llamacrab_slots_busy 0" in httpx.get(server.url + "/metrics").text
        # The same for a whole (non-streamed) completion whose client gives up waiting.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", timeout=1.0,
                       json={**body, "stream": False})  # fmt: skip
        started = time.perf_counter()
        follow = httpx.post(server.url + "/v1/completions", timeout=60,
                            json={"prompt": "Hi", "max_tokens": 4})  # fmt: skip
        assert follow.status_code == 200 and time.perf_counter() - started < 20


def wait_for(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        time.sleep(0.01)


def _sent(url: str, path: str, body: dict[str, object]) -> socket.socket:
    """A request sent on a raw connection, which the test closes without reading an answer."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    connection = socket.create_connection((host, int(port)))
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                       f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)  # fmt: skip
    return connection


_SAID = [{"role": "user", "content": "hello there"}]
STREAMS = {  # every route that streams, each asked for a stream
    "/completion": {"prompt": "hello there", "n_predict": 4},
    "/v1/completions": {"prompt": "hello there", "max_tokens": 4},
    "/v1/chat/completions": {"messages": _SAID, "max_tokens": 4},
    "/v1/messages": {"model": "m", "messages": _SAID, "max_tokens": 4},
    "/v1/responses": {"input": "hello there", "max_output_tokens": 4},
}


@contextlib.contextmanager
def _one_slot_held(
    tiny_path: Path,
) -> Iterator[tuple[LiveServer, Scheduler, Gate, Callable[[], None]]]:
    """A server on a one-slot Llama whose slot a completion holds behind ``gate`` until the
    function given with it (which waits for that completion) is called; called on leaving
    in any case."""
    gate = Gate()
    llama = Llama(tiny_path, n_ctx=256, parallel=1)
    scheduler = llama.scheduler
    assert scheduler is not None
    holder = threading.Thread(target=lambda: llama.create_completion(
        "x", max_tokens=2, custom_samplers=(gate,)))  # fmt: skip

    def release() -> None:
        gate.open.set()
        if holder.is_alive():
            holder.join(timeout=30)

    try:
        for server in _running(ServerSettings(model=str(tiny_path)), llama):
            holder.start()
            wait_for(lambda: scheduler.busy_slots == 1)  # it holds the only slot
            yield server, scheduler, gate, release
            release()
    finally:
        release()
        llama.close()


def test_a_stream_whose_client_leaves_while_queued_never_takes_a_slot(tiny_path: Path) -> None:
    # Found by an audit: a dropped stream waited for a slot all the same, then decoded its
    # prompt and sampled (a whole answer was cancelled at once); the first chunk was awaited
    # before anything watched the client.
    with _one_slot_held(tiny_path) as (server, scheduler, gate, _):
        for path, body in STREAMS.items():
            connection = _sent(server.url, path, {**body, "stream": True})
            wait_for(lambda: scheduler.queue_depth == 1)
            connection.close()
            wait_for(lambda: scheduler.queue_depth == 0)  # out of the queue, never decoded
            assert scheduler.busy_slots == 1 and not gate.open.is_set(), path
        assert "llamacpp:requests_deferred 0" in httpx.get(server.url + "/metrics").text


def test_a_client_that_leaves_is_counted_as_closed_not_as_a_server_error(tiny_path: Path) -> None:
    # Its stopped generation answered 503 shutting_down (to nobody), and /metrics counted a
    # server error for every client that gave up.
    def answered(path: str) -> dict[str, int]:
        metrics = httpx.get(server.url + "/metrics").text
        found = re.findall(rf'llamacrab_requests_total{{route="{path}",status="(\d+)"}} (\d+)',
                           metrics)  # fmt: skip
        return {status: int(count) for status, count in found}

    with _one_slot_held(tiny_path) as (server, scheduler, _, release):
        for path, body in STREAMS.items():  # a stream leaves the queue at once
            connection = _sent(server.url, path, {**body, "stream": True})
            wait_for(lambda: scheduler.queue_depth == 1)
            connection.close()
            wait_for(lambda at=path: answered(at) != {})  # type: ignore[misc]
        # A whole answer is dropped from the queue when the engine next looks.
        connections = [_sent(server.url, path, body) for path, body in STREAMS.items()]
        wait_for(lambda: scheduler.queue_depth == len(STREAMS))
        for connection in connections:
            connection.close()
        wait_for(lambda: all(job.session.stopped() for job in scheduler.waiting))
        release()
        for path in STREAMS:
            wait_for(lambda at=path: sum(answered(at).values()) == 2)  # type: ignore[misc]
            assert answered(path) == {"499": 2}, path


_CLOSED = 'llamacrab_requests_total{route="/v1/completions",status="499"}'


def _metric(server: LiveServer, name: str) -> float:
    """A value /metrics shows (0 where it shows none yet)."""
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(server.url + "/metrics").text, re.M)
    return 0 if found is None else float(found.group(1))


def test_the_tokens_of_a_whole_answer_whose_client_left_still_count(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The 499 was raised before the tokens computed were counted: /metrics lost them.
    llama = Llama(tiny_path, n_ctx=256)
    create, computed = llama.create_completion, threading.Event()

    def held(*args: Any, cancel: threading.Event, **kwargs: Any) -> Any:
        result = create(*args, cancel=cancel, **kwargs)
        computed.set()
        assert cancel.wait(30)  # the server saw its client leave
        return result

    monkeypatch.setattr(llama, "create_completion", held)
    try:
        for server in _running(ServerSettings(model=str(tiny_path)), llama):
            body = {"prompt": "hello there", "max_tokens": 3, "min_tokens": 3}
            connection = _sent(server.url, "/v1/completions", body)
            assert computed.wait(30)
            connection.close()
            wait_for(lambda at=server: _metric(at, _CLOSED) == 1)  # type: ignore[misc]
            assert _metric(server, "llamacpp:tokens_predicted_total") == 3
            prompt = len(llama.tokenize("hello there"))
            assert _metric(server, "llamacpp:prompt_tokens_total") == prompt
    finally:
        llama.close()


def test_a_whole_answer_whose_model_closes_while_it_generates_is_a_503(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As at shutdown: its tokens are counted now, and it is still answered 503 shutting_down.
    llama = Llama(tiny_path, n_ctx=256)
    create, slow = llama.create_completion, Slow(delay=0.05)

    def slowed(*args: Any, **kwargs: Any) -> Any:
        return create(*args, custom_samplers=(slow,), **kwargs)

    monkeypatch.setattr(llama, "create_completion", slowed)
    try:
        for server in _running(ServerSettings(model=str(tiny_path)), llama):
            with ThreadPoolExecutor(1) as pool:
                body = {"prompt": "hi", "max_tokens": 200, "min_tokens": 200}
                answer = pool.submit(httpx.post, server.url + "/v1/completions", json=body,
                                     timeout=60)  # fmt: skip
                wait_for(lambda: slow.calls > 2)
                llama.close()
                closed = answer.result()
            assert closed.status_code == 503, closed.text
            assert closed.json()["error"]["code"] == "shutting_down"
    finally:
        llama.close()


def test_a_request_left_unanswered_after_its_client_left_counts_as_closed() -> None:
    # A request forwarded to an isolated model's process ends so: it was counted as a 500.
    from llamacrab.server._guards import MetricsMiddleware
    from llamacrab.server._metrics import Metrics

    async def leaves(scope: Any, receive: Any, send: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def fails(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("a bug")

    async def main(app: Any) -> None:
        messages = iter([{"type": "http.request", "body": b""}, {"type": "http.disconnect"}])

        async def receive() -> dict[str, Any]:
            return next(messages)

        async def send(message: Any) -> None:
            raise AssertionError("nothing is sent")

        with contextlib.suppress(RuntimeError):
            await MetricsMiddleware(app, metrics)({"type": "http", "path": "/x"}, receive, send)

    metrics = Metrics()
    asyncio.run(main(leaves))
    asyncio.run(main(fails))
    assert dict(metrics.requests) == {("unmatched", 499): 1, ("unmatched", 500): 1}


class Turnstile(CustomSampler):
    """A sampler that holds the engine thread at each token until the test lets one step
    through (``permits.release()``); ``arrivals`` counts the tokens it was asked for."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.arrivals = 0

    def apply(self, candidates: np.ndarray) -> None:
        self.arrivals += 1
        assert self.permits.acquire(timeout=30)


def test_a_stream_whose_client_leaves_during_its_prompt_stops_decoding_it(tiny_path: Path) -> None:
    # A first slot's generation, one token per step, paces the engine; a second slot's prompt
    # is decoded a batch at a time beside it.
    turnstile = Turnstile()
    llama = Llama(tiny_path, n_ctx=1024, parallel=2, n_batch=16, n_ubatch=16)
    scheduler = llama.scheduler
    assert scheduler is not None
    prompt = " ".join(["hello there"] * 25)
    length = len(llama.tokenize(prompt))
    assert 160 < length < 500  # ten steps and more, in a slot's 512

    def prompt_slot() -> dict[str, int]:
        held = [s for s in httpx.get(server.url + "/slots").json() if s["n_prompt_tokens"] > 12]
        assert len(held) == 1  # the pacing slot holds 3 + 8 tokens at most
        return held[0]  # type: ignore[no-any-return]

    try:
        for server in _running(ServerSettings(model=str(tiny_path)), llama):
            pacer = threading.Thread(target=lambda: llama.create_completion(
                "x", max_tokens=8, min_tokens=8, custom_samplers=(turnstile,)))  # fmt: skip
            pacer.start()
            wait_for(lambda: turnstile.arrivals == 1)
            body = {"prompt": prompt, "n_predict": 4, "stream": True}
            connection = _sent(server.url, "/completion", body)
            wait_for(lambda: scheduler.queue_depth == 1)
            for step in (2, 3):  # two batches of its prompt decoded
                turnstile.permits.release()
                wait_for(lambda at=step: turnstile.arrivals == at)  # type: ignore[misc]
            decoded = prompt_slot()["n_prompt_tokens"]
            assert 0 < decoded < length
            connection.close()
            # The server notices while the engine waits between two steps; the next step ends it.
            wait_for(lambda: any(s.job is not None and s.job.session.stopped()
                                 for s in scheduler.slots))  # fmt: skip
            turnstile.permits.release(100)
            pacer.join(timeout=30)
            wait_for(lambda: scheduler.busy_slots == 0)
            assert prompt_slot()["n_prompt_tokens"] <= decoded + 16  # a batch more at most
    finally:
        turnstile.permits.release(100)
        llama.close()


@pytest.mark.parametrize("stream", [False, True])  # a stream too: it has sent nothing yet
def test_a_full_queue_answers_503_and_a_request_past_its_timeout_504_not_retried(
    tiny_path: Path, stream: bool
) -> None:
    gate = Gate()
    llama = Llama(tiny_path, n_ctx=256, parallel=1, max_queue=1)
    scheduler = llama.scheduler
    assert scheduler is not None
    try:
        for server in _running(ServerSettings(model=str(tiny_path), timeout=0.5), llama):
            holder = threading.Thread(target=lambda: llama.create_completion(
                "x", max_tokens=2, custom_samplers=(gate,)))  # fmt: skip
            holder.start()
            wait_for(lambda: scheduler.busy_slots == 1)  # it holds the only slot (and the engine)
            with ThreadPoolExecutor(1) as pool:
                asked = {"prompt": "hi", "stream": stream}
                queued = pool.submit(httpx.post, server.url + "/v1/completions", json=asked,
                                     timeout=30)  # fmt: skip
                wait_for(lambda: scheduler.queue_depth == 1)  # waiting in the queue, now full
                queued_by = time.monotonic()  # its 0.5 s started before this
                busy = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
                assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
                assert "x-should-retry" not in busy.headers  # the SDKs retry: a slot may free
                # Anthropic's clients: its 529 overloaded_error (the SDK's OverloadedError).
                message = {"model": "m", "max_tokens": 2,
                           "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
                overloaded = httpx.post(server.url + "/v1/messages", json=message)
                assert overloaded.status_code == 529, overloaded.text
                assert overloaded.json()["error"]["type"] == "overloaded_error"
                assert scheduler.queue_depth == 1 and not queued.done()
                # The queued request's 0.5 s pass while the gate still holds the slot (a
                # deadline, not an ordering): it is dropped from the queue as timed out.
                time.sleep(max(0.0, queued_by + 0.6 - time.monotonic()))
                gate.open.set()
                late = queued.result()
            assert late.status_code == 504 and late.json()["error"]["code"] == "timeout"
            # Asked again it would time out again: the SDKs are told not to retry it.
            assert late.headers["x-should-retry"] == "false"
            holder.join(timeout=30)
            ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200
    finally:
        llama.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/completion"])
def test_the_prompts_of_one_request_share_its_timeout(
    tiny_path: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llama = Llama(tiny_path, n_ctx=256)
    create = llama.create_completion
    given: list[float] = []

    def slow(*args: Any, **kwargs: Any) -> Any:  # each prompt takes 0.4 s of the request's 1 s
        given.append(kwargs["timeout"])
        time.sleep(0.4)
        return create(*args, **kwargs)

    monkeypatch.setattr(llama, "create_completion", slow)
    try:
        for server in _running(ServerSettings(model=str(tiny_path), timeout=1.0), llama):
            body = {"prompt": ["a", "b", "c", "d"], "max_tokens": 2}
            late = httpx.post(server.url + path, json=body, timeout=30)
            # Each prompt had a fresh second: four took 1.6 s and answered 200.
            assert late.status_code == 504 and late.json()["error"]["code"] == "timeout"
            assert len(given) == 3 and given[0] <= 1.0 and given[2] <= 0.2  # the 4th: none
            given.clear()
            body["prompt"] = ["a", "b"]
            assert httpx.post(server.url + path, json=body, timeout=30).status_code == 200
    finally:
        llama.close()


# -- security and bad input ----------------------------------------------------------------------


def test_api_keys_guard_every_route_but_health(guarded_server: LiveServer) -> None:
    url = guarded_server.url
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    for key in ("sesame", "other"):
        ok = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
    assert httpx.get(url + "/metrics").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        sdk(guarded_server, "nope").models.list()


def test_keys_and_tokens_never_leak_into_answers_or_logs(
    tiny_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys, token = ("sk-crab-2c41f0", "sk-crab-9e77aa"), "hf_crab_51d3e8"
    secrets = (*keys, token)
    settings = ServerSettings(model=str(tiny_path), api_keys=keys, hf_token=token, n_ctx=256)
    caplog.set_level(logging.DEBUG)
    answers: list[httpx.Response] = []
    for server in _running(settings):
        ok = [{"Authorization": f"Bearer {keys[0]}"}, {"x-api-key": keys[1]}]
        wrong = [{"Authorization": f"Bearer {keys[0]}x"}, {"x-api-key": keys[1][:-1]}, {}]
        for path in ("/props", "/slots", "/metrics", "/v1/models", "/openapi.json", "/health"):
            answers += [httpx.get(server.url + path, headers=h) for h in ok]
        answers += [httpx.get(server.url + "/v1/models", headers=h) for h in wrong]
        answers += [httpx.post(server.url + "/v1/completions", headers=ok[0],
                               json={"prompt": "hi", "max_tokens": 2})]  # fmt: skip
    assert [a.status_code for a in answers] == [200] * 12 + [401] * 3 + [200]
    for answer in answers:
        for secret in secrets:
            assert secret not in answer.text and secret not in str(answer.headers), answer.url
    for secret in secrets:
        assert secret not in caplog.text and secret not in repr(settings)


def test_a_non_loopback_address_needs_a_key_or_insecure(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidParameterError, match="without an API key"):
        ServerSettings(model="m.gguf", host="0.0.0.0").check_exposure()
    ServerSettings(model="m.gguf", host="0.0.0.0", api_keys=("k",)).check_exposure()
    ServerSettings(model="m.gguf", host="0.0.0.0", insecure=True).check_exposure()
    ServerSettings(model="m.gguf", host="::1").check_exposure()
    assert cli_main(["serve", "m.gguf", "--host", "0.0.0.0"]) == 1
    assert "refusing to listen on 0.0.0.0" in capsys.readouterr().err


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(
    guarded_server: LiveServer,
) -> None:
    url, auth = guarded_server.url, {"Authorization": "Bearer sesame"}

    def post(body: object, route: str = "/v1/completions", **kw: object) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {**auth, "Content-Type": "application/json"}
        return httpx.post(url + route, content=content, headers=headers, **kw)  # type: ignore[arg-type]

    cases = [
        (b"{not json", 400, "JSON"),
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x" * 5000}, 413, "exceeds 4096 bytes"),
        ({"prompt": [5] * 300}, 400, "context holds"),
        ({"prompt": "hi", "n": 3}, 400, "limit of 2"),
        ({"prompt": "hi", "grammar": "root ::= nonsense"}, 400, "grammar"),
        ({"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
        ({"prompt": ""}, 400, "empty"),
        ({"messages": []}, 400, "messages"),
        # Outputs this server cannot make were accepted and an ordinary text answered.
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "modalities": ["text", "audio"],
                "audio": {"voice": "alloy", "format": "wav"},
            },
            400,
            "only text answers",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "web_search_options": {}},
            400,
            "web search",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "verbosity": "low"}, 400, "verbosity"),
    ]
    for body, status, words in cases:
        route = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else None
        response = post(body, route or "/v1/completions")
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert words.lower() in error["message"].lower(), (body, error)
        assert set(error) - {"n_prompt_tokens", "n_ctx"} == {"message", "type", "param", "code"}
    # A validation error names its field in param (OpenAI's); bad JSON says so.
    assert post({"prompt": "hi", "temperature": -1}).json()["error"]["param"] == "temperature"
    broken = post(b"{not json").json()["error"]["message"]
    assert broken.startswith("the body is not valid JSON (at character 1): Expecting"), broken
    overflow = post({"prompt": [5] * 300}).json()["error"]
    assert overflow["code"] == "context_length_exceeded"
    assert (overflow["n_prompt_tokens"], overflow["n_ctx"]) == (300, 256)  # as llama-server
    assert post({"prompt": "hi", "max_tokens": 3}).status_code == 200
    assert httpx.get(url + "/nowhere", headers=auth).json()["error"]["type"] == "not_found_error"
    # A max_tokens past --max-tokens-limit is cut to it (a 400 before): clients ask for 8,192
    # to 32,000 tokens, and llama-server stops at its context.
    cut = post({"prompt": "hi", "max_tokens": 32_000, "ignore_eos": True}).json()
    assert (cut["usage"]["completion_tokens"], cut["choices"][0]["finish_reason"]) == (
        100,
        "length",
    )
    # llama-server skips empty stop strings; an empty one was a 400.
    for stop in ("", ["", "never"]):
        kept = post({"prompt": "hi", "max_tokens": 3, "stop": stop, "ignore_eos": True}).json()
        assert kept["usage"]["completion_tokens"] == 3, (stop, kept)


def test_a_context_overflow_is_answered_as_llama_server_does(guarded_server: LiveServer) -> None:
    """llama-server's type and wording beside OpenAI's code (clients match on any of them), on
    every route that generates, streamed or not. It was invalid_request_error, "the prompt has
    N tokens; the context holds M"."""
    url, auth = guarded_server.url, {"Authorization": "Bearer sesame"}
    long = "a b c " * 200
    asked = [{"role": "user", "content": long}]
    bodies = [("/v1/completions", {"prompt": [5] * 300}),
              ("/completion", {"prompt": [5] * 300, "stream": True}),
              ("/v1/chat/completions", {"messages": asked}),
              ("/v1/chat/completions", {"messages": asked, "stream": True}),
              ("/v1/responses", {"input": long})]  # fmt: skip
    for route, body in bodies:
        answer = httpx.post(url + route, json=body, headers=auth)
        assert answer.status_code == 400, (route, answer.text)
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("exceed_context_size_error",
                                                  "context_length_exceeded")  # fmt: skip
        n = error["n_prompt_tokens"]
        assert n >= error["n_ctx"] == 256, (route, error)
        native = f"request ({n} tokens) exceeds the available context size (256 tokens), try"
        assert error["message"].startswith(native), (route, error)
    # Anthropic's shape keeps its own type; the wording is llama-server's there too.
    body = {"model": "m", "max_tokens": 4, "messages": asked}
    anthropic = httpx.post(url + "/v1/messages", json=body, headers=auth)
    assert anthropic.status_code == 400
    assert "exceeds the available context size" in anthropic.json()["error"]["message"]


def test_health_reports_loading_failures(tmp_path: Path) -> None:
    server = LiveServer(ServerSettings(model=str(tmp_path / "missing.gguf")))
    try:
        assert server.wait_until_loaded() == 503
        assert httpx.get(server.url + "/health").json()["status"] == "error"
        answer = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
        assert answer.status_code == 503 and "failed to load" in answer.json()["error"]["message"]
    finally:
        server.close()


def test_a_port_past_65535_is_refused() -> None:
    # uvicorn listened on 99999 % 65536 and logged 99999.
    with pytest.raises(InvalidParameterError, match="port must be 1-65535, not 99999"):
        ServerSettings(model="m.gguf", port=99999)


@pytest.mark.parametrize("timeout", [math.nan, math.inf, 1e300, 0, -1])
def test_a_timeout_that_no_deadline_can_hold_is_refused(timeout: float) -> None:
    # Found by an audit: NaN failed every request (a 500 on isolated models), inf and 1e300
    # overflowed a child's deadline.
    with pytest.raises(InvalidParameterError, match="timeout must be > 0 and at most"):
        ServerSettings(model="m.gguf", timeout=timeout)


def test_a_bad_environment_variable_is_named_when_its_flag_is_used(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Found by an audit: a traceback while the flags were built, in every subcommand.
    for variable, value in (("LLAMACRAB_PORT", "abc"), ("LLAMACRAB_INSECURE", "maybe"),
                            ("LLAMACRAB_CONTROL_VECTOR_LAYER_RANGE", "1,x")):  # fmt: skip
        with pytest.raises(InvalidParameterError, match=f"^{variable}='{value}': "):
            parse_settings(["m.gguf"], {variable: value})
    assert parse_settings(["m.gguf", "--port", "9000"], {"LLAMACRAB_PORT": "abc"}).port == 9000
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLAMACRAB_PORT", "abc")
        with pytest.raises(SystemExit) as shown:
            cli_main(["run", "--help"])
    assert shown.value.code == 0 and "--max-tokens" in capsys.readouterr().out


def test_server_flags_on_a_parser_of_ones_own() -> None:
    # add_arguments was public, but the namespace it fills could only become settings through
    # a private function.
    parser = argparse.ArgumentParser(prog="mine")
    parser.add_argument("--verbose-mine", action="store_true")
    add_arguments(parser, {"LLAMACRAB_PARALLEL": "3", "LLAMACRAB_PORT": "abc"})
    args = parser.parse_args(["m.gguf", "--verbose-mine", "--port", "9001"])
    settings = settings_from_args(args)
    assert (settings.model, settings.parallel, settings.port) == ("m.gguf", 3, 9001)
    assert args.verbose_mine
    with pytest.raises(InvalidParameterError, match=r"^LLAMACRAB_PORT='abc': "):
        settings_from_args(parser.parse_args(["m.gguf"]))


@pytest.mark.parametrize("keys", [("",), ("sk-1", "  ")])
def test_an_empty_api_key_is_refused(keys: tuple[str, ...]) -> None:
    # It matched an empty x-api-key header: anyone was let in, and --host 0.0.0.0 started
    # without --insecure.
    with pytest.raises(InvalidParameterError, match="an API key is empty or blank"):
        ServerSettings(model="m.gguf", api_keys=keys)


def test_settings_come_from_flags_and_environment() -> None:
    environ = {"LLAMACRAB_MODEL": "m.gguf", "LLAMACRAB_PARALLEL": "4",
               "LLAMACRAB_API_KEY": "sk-env-4f1a, sk-env-8b2c", "LLAMACRAB_EMBEDDINGS": "true",
               "LLAMACRAB_TIMEOUT": "2.5", "LLAMACRAB_HF_TOKEN": "hf_env_token_77d3"}  # fmt: skip
    settings = parse_settings(["--port", "9000", "--api-key", "sk-flag-0c9e"], environ)
    assert (settings.model, settings.parallel, settings.port) == ("m.gguf", 4, 9000)
    assert settings.api_keys == ("sk-env-4f1a", "sk-env-8b2c", "sk-flag-0c9e")
    assert settings.embeddings and settings.timeout == 2.5
    assert settings.hf_token == "hf_env_token_77d3"
    for secret in (*settings.api_keys, "hf_env_token_77d3"):  # keys stay out of reprs
        assert secret not in repr(settings) and secret not in str(settings)
    assert parse_settings(["--model", "x.gguf"], {}).host == "127.0.0.1"
    checkpoints = parse_settings(["m.gguf", "--ctx-checkpoints", "0"], {})
    assert generation_kwargs(checkpoints)["ctx_checkpoints"] == 0
    with pytest.raises(InvalidParameterError, match="unknown pooling"):
        parse_settings(["m.gguf", "--pooling", "avg"], {})
    with pytest.raises(InvalidParameterError, match="no model"):
        parse_settings([], {})


def test_a_failing_disconnect_watch_still_stops_the_work() -> None:
    # Found by review: only a cancellation stopped the work; the watch raising otherwise left a
    # generation running with nobody to read it.
    from llamacrab.server._streaming import until_disconnected

    stopped: list[bool] = []

    class Client:
        async def is_disconnected(self) -> bool:
            raise RuntimeError("the watch failed")

    async def main() -> None:
        release = asyncio.Event()

        async def work() -> None:
            await release.wait()  # a generation, until it is stopped
            raise ValueError("ended by the stop")

        def stop() -> None:
            stopped.append(True)
            release.set()

        with pytest.raises(RuntimeError, match="the watch failed"):
            await until_disconnected(Client(), work(), stop)  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # the work ends; what it raised is nobody's

    asyncio.run(main())
    assert stopped == [True]
