"""The multi-model server (``--models FILE.toml`` / ``--models-dir``), live on loopback and
driven by the openai SDK: routing by model, load on demand, load/unload, eviction under
max_loaded and a memory budget, keep-alive, a broken entry beside good ones."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from live_server import LiveServer
from test_tool_calls import TEMPLATE

from llamacrab import (
    CompletionChunk,
    InvalidParameterError,
    ModelBudgetError,
    ModelEntry,
    ModelRegistry,
    estimate_memory,
)
from llamacrab._features.models_dir import scan_models_dir
from llamacrab.server import ServerSettings, parse_settings
from llamacrab.server._app import create_app
from llamacrab.server._errors import ApiError
from llamacrab.server._state import ServerState
from llamacrab.server._streaming import sse_events

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
KEY = "sesame"
TINY = "n_ctx = 256\nn_threads = 1\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("served")
    for i, name in enumerate(("alpha", "beta", "gamma")):
        tiny.write_tiny_llama(out / f"{name}.gguf", seed=i, chat_templates={"": TEMPLATE})
    load_repo_module("scripts/convert_bert.py").write_tiny_reranker(out / "ranker.gguf")
    (out / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    return out


def _serve(settings: ServerSettings) -> Iterator[LiveServer]:
    server = LiveServer(settings)
    try:
        assert server.wait_until_loaded() == 200
        yield server
    finally:
        server.close()


def _toml(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def mixed(folder: Path, gemma_path: Path) -> Iterator[LiveServer]:
    """Gemma (chat), MiniLM (embeddings), a reranker, a tiny model and a broken file."""
    minilm = load_repo_module("scripts/convert_bert.py").minilm()
    config = _toml(
        folder / "mixed.toml",
        f"""
[models.gemma]
model = "{gemma_path}"
n_ctx = 1024
parallel = 2
n_threads = 2
[models.minilm]
model = "{minilm}"
embeddings = true
n_threads = 1
[models.ranker]
model = "ranker.gguf"
embeddings = true
pooling = "rank"
[models.alpha]
model = "alpha.gguf"
{TINY}
[models.broken]
model = "broken.gguf"
""",
    )
    yield from _serve(ServerSettings(model="", models=config, api_keys=(KEY,), n_threads=1))


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def statuses(server: LiveServer) -> dict[str, dict[str, Any]]:
    response = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200
    return {m["id"]: m["status"] for m in response.json()["data"]}


def post(server: LiveServer, path: str, body: dict[str, Any], key: str = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def _wait_for(predicate: Any, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- one server of several models --------------------------------------------------------------


@pytest.mark.real_model
def test_models_are_listed_with_their_status_and_load_on_demand(mixed: LiveServer) -> None:
    listed = {m.id: m for m in sdk(mixed).models.list()}
    assert set(listed) == {"gemma", "minilm", "ranker", "alpha", "broken"}
    assert listed["minilm"].model_extra and listed["minilm"].model_extra["kind"] == "embeddings"
    chat = sdk(mixed).chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "Say hello."}], max_tokens=4,
        temperature=0,
    )  # fmt: skip
    assert chat.model == "gemma" and chat.usage and chat.usage.completion_tokens >= 1
    vectors = sdk(mixed).embeddings.create(model="minilm", input=["a crab", "the sea"])
    assert vectors.model == "minilm" and len(vectors.data[0].embedding) == 384
    ranked = post(mixed, "/v1/rerank", {"model": "ranker", "query": "crab",
                                         "documents": ["the sea", "a cat"]})  # fmt: skip
    assert ranked.status_code == 200 and len(ranked.json()["results"]) == 2
    now = statuses(mixed)
    assert {now[n]["value"] for n in ("gemma", "minilm", "ranker")} == {"loaded"}
    assert now["alpha"]["value"] == "unloaded" and now["gemma"]["estimated_bytes"] > 2**20
    # llama-server's meta where the model is loaded (its n_ctx, ...); none where it is not.
    cards = {m.id: m.model_extra or {} for m in sdk(mixed).models.list()}
    assert cards["gemma"]["meta"]["n_vocab"] == 262144 and cards["minilm"]["meta"]["n_embd"] == 384
    assert "meta" not in cards["alpha"] and cards["alpha"]["aliases"] == ["alpha"]


@pytest.mark.real_model
def test_unknown_and_incapable_models_are_refused_in_openai_shape(mixed: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk(mixed).completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    assert unknown.value.code == "model_not_found" and "gpt-4" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        hello = [{"role": "user", "content": "hi"}]
        sdk(mixed).chat.completions.create(model="minilm", max_tokens=1, messages=hello)
    assert refused.value.code == "model_not_capable"
    assert "'minilm' is for embeddings: it cannot generate text" in refused.value.message
    with pytest.raises(openai.BadRequestError, match="is for generation: it cannot compute"):
        sdk(mixed).embeddings.create(model="alpha", input="hi")
    assert statuses(mixed)["alpha"]["value"] == "unloaded"  # refused before loading


@pytest.mark.real_model
def test_a_broken_model_reports_why_and_the_others_keep_serving(mixed: LiveServer) -> None:
    with pytest.raises(openai.InternalServerError) as failed:
        sdk(mixed).completions.create(model="broken", prompt="hi", max_tokens=1)
    assert failed.value.code == "model_load_failed" and "broken.gguf" in failed.value.message
    status = statuses(mixed)["broken"]
    assert status["value"] == "failed" and "broken.gguf" in status["error"]
    health = httpx.get(mixed.url + "/health", params={"model": "broken"})
    assert health.status_code == 503 and "broken.gguf" in health.json()["error"]
    assert httpx.get(mixed.url + "/health").json()["models"]["broken"]["value"] == "failed"
    # min_tokens: the random tiny model may sample its end token first.
    answer = sdk(mixed).completions.create(
        model="alpha", prompt="the cat", max_tokens=2, extra_body={"min_tokens": 2}
    )
    assert answer.model == "alpha" and answer.usage and answer.usage.completion_tokens == 2


@pytest.mark.real_model
def test_concurrent_requests_to_two_models(mixed: LiveServer) -> None:
    def chat(i: int) -> str:
        result = sdk(mixed).chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=16, temperature=0,
        )  # fmt: skip
        return result.model

    def embed(i: int) -> str:
        return sdk(mixed).embeddings.create(model="minilm", input=f"text {i}").model

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(chat, i) for i in range(3)]
        futures += [pool.submit(embed, i) for i in range(3)]
        assert sorted(f.result() for f in futures) == ["gemma"] * 3 + ["minilm"] * 3
    metrics = httpx.get(mixed.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'llamacrab_model_loaded{model="gemma"} 1' in metrics
    assert 'llamacrab_model_in_use{model="minilm"} 0' in metrics


@pytest.mark.real_model
def test_load_and_unload_routes_need_the_key(mixed: LiveServer) -> None:
    assert post(mixed, "/models/load", {"model": "alpha"}, key="wrong").status_code == 401
    loaded = post(mixed, "/models/load", {"model": "alpha"})
    assert loaded.status_code == 200 and loaded.json()["status"]["value"] == "loaded"
    assert post(mixed, "/models/load", {"model": "nope"}).status_code == 404
    unloaded = post(mixed, "/models/unload", {"model": "alpha"})
    assert unloaded.json()["unloaded"] is True and statuses(mixed)["alpha"]["value"] == "unloaded"
    assert post(mixed, "/models/unload", {"model": "alpha"}).json()["unloaded"] is False


@pytest.mark.real_model
def test_routes_without_a_model_name_one_when_several_are_served(mixed: LiveServer) -> None:
    unnamed = post(mixed, "/extras/tokenize", {"input": "the cat"})
    assert unnamed.status_code == 400 and "alpha" in unnamed.json()["error"]["message"]
    named = post(mixed, "/extras/tokenize", {"input": "the cat", "model": "alpha"})
    assert named.status_code == 200 and named.json()["tokens"]
    assert httpx.get(mixed.url + "/health", params={"model": "nope"}).status_code == 404


# -- limits ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(folder: Path, gemma_path: Path) -> Iterator[LiveServer]:
    config = _toml(
        folder / "limited.toml",
        f"""
max_loaded = 2
[models.alpha]
model = "alpha.gguf"
{TINY}
[models.beta]
model = "beta.gguf"
{TINY}
[models.gemma]
model = "{gemma_path}"
n_ctx = 512
n_threads = 2
""",
    )
    yield from _serve(ServerSettings(model="", models=config, api_keys=(KEY,)))


@pytest.mark.real_model
def test_max_loaded_evicts_the_least_recently_used(limited: LiveServer) -> None:
    for name in ("alpha", "beta", "gemma"):
        assert sdk(limited).completions.create(model=name, prompt="the", max_tokens=1).model == name
    now = statuses(limited)
    assert [now[n]["value"] for n in ("alpha", "beta", "gemma")] == ["unloaded", "loaded", "loaded"]


@pytest.mark.real_model
def test_a_model_generating_is_never_evicted(limited: LiveServer) -> None:
    post(limited, "/models/unload", {"model": "beta"})
    stream = sdk(limited).chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "Write a long story."}],
        max_tokens=64, temperature=0, stream=True,
    )  # fmt: skip
    next(iter(stream))  # generating now
    assert statuses(limited)["gemma"]["in_use"] == 1
    sdk(limited).completions.create(model="alpha", prompt="the", max_tokens=1)
    # Gemma is the least recently used, but it is generating: alpha makes room instead.
    sdk(limited).completions.create(model="beta", prompt="the", max_tokens=1)
    now = statuses(limited)
    assert [now[n]["value"] for n in ("alpha", "beta", "gemma")] == ["unloaded", "loaded", "loaded"]
    assert len(list(stream)) > 1  # the stream went on to its end
    assert _wait_for(lambda: statuses(limited)["gemma"]["in_use"] == 0)


@pytest.mark.real_model
def test_a_client_gone_while_its_model_loads_leaves_no_lease(limited: LiveServer) -> None:
    post(limited, "/models/unload", {"model": "gemma"})
    with pytest.raises(httpx.TimeoutException):
        httpx.post(limited.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "gemma", "prompt": "the", "max_tokens": 1},
                   timeout=0.05)  # fmt: skip
    assert _wait_for(lambda: statuses(limited)["gemma"]["value"] == "loaded", timeout=60)
    assert _wait_for(lambda: statuses(limited)["gemma"]["in_use"] == 0)


def test_memory_budget_and_keep_alive(folder: Path) -> None:
    one = estimate_memory(folder / "alpha.gguf", n_ctx=256, parallel=1).total
    config = _toml(
        folder / "budget.toml",
        f"""
memory_budget = {int(one * 2.5)}
[models.alpha]
model = "alpha.gguf"
{TINY}
[models.beta]
model = "beta.gguf"
{TINY}
[models.gamma]
model = "gamma.gguf"
keep_alive = 3  # seconds: outlasts the status check below on a loaded machine
{TINY}
""",
    )
    for server in _serve(ServerSettings(model="", models=config, parallel=1)):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for name in ("alpha", "beta", "gamma"):
            client.completions.create(model=name, prompt="the", max_tokens=1)
        now = statuses_open(server)
        assert [now[n] for n in ("alpha", "beta", "gamma")] == ["unloaded", "loaded", "loaded"]
        gone = lambda at=server: statuses_open(at)["gamma"] == "unloaded"  # noqa: E731
        assert _wait_for(gone, timeout=30)
        assert statuses_open(server)["beta"] == "loaded"  # no keep_alive: stays


def test_a_forced_unload_answers_its_requests_503_and_a_context_too_large_fails_to_load(
    folder: Path,
) -> None:
    # Found by the server's models section: a whole completion cancelled by a forced unload
    # was answered 504 "ran past the timeout", and an entry whose context llama.cpp could not
    # hold a bare 500 (its ContextError escaped the routes) on its first use.
    config = _toml(
        folder / "unload.toml",
        f'[models.alpha]\nmodel = "alpha.gguf"\nn_ctx = 4096\nn_threads = 1\n'
        f'[models.huge]\nmodel = "alpha.gguf"\nn_ctx = {2**31 - 1}\nn_threads = 1\n',
    )
    for server in _serve(ServerSettings(model="", models=config)):
        body = {"model": "alpha", "prompt": "the", "max_tokens": 4000, "min_tokens": 4000}

        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(httpx.post, server.url + "/v1/completions", json=body,
                                  timeout=120)  # fmt: skip
            loaded = lambda at=server: statuses_open(at)["alpha"] == "loaded"  # noqa: E731
            assert _wait_for(loaded)
            time.sleep(0.3)  # generating now
            waiting = pool.submit(
                stream_lines, server.url + "/v1/completions", {**body, "stream": True}
            )  # one slot: it waits its turn
            time.sleep(0.3)
            forced = httpx.post(server.url + "/models/unload", json={"model": "alpha",
                                                                     "force": True})  # fmt: skip
            assert forced.json()["unloaded"] is True
            answer = running.result(timeout=60)
            status, lines = waiting.result(timeout=60)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down"
        assert "unloaded" in answer.json()["error"]["message"]
        # A stream waiting for the slot has no answer yet: it gets the same 503.
        assert status == 503 and json.loads(lines[0])["error"]["code"] == "shutting_down"
        huge = httpx.post(server.url + "/v1/completions",
                          json={"model": "huge", "prompt": "the", "max_tokens": 1})  # fmt: skip
        assert huge.status_code == 500 and huge.json()["error"]["code"] == "model_load_failed"
        assert "host memory" in huge.json()["error"]["message"]


def test_a_stream_cancelled_before_its_deadline_ends_with_shutting_down_not_timeout() -> None:
    # Found by the server's isolated section: a stream whose model was unloaded by force while
    # it generated (its generation ended "cancelled") ended with a "timeout" error event.
    async def ending(timeout: float) -> list[str]:
        state = ServerState(ServerSettings(model="m", timeout=timeout), None)

        class Chunks:  # a Stream's chunks, with the deadline its session was given
            session = SimpleNamespace(deadline=time.monotonic() + timeout)
            last_sent = False

            def cancel(self) -> None:  # streams are cancelled once read, never while the client is
                assert self.last_sent, "cancelled while the client was still there"

            async def __aiter__(self) -> AsyncIterator[CompletionChunk]:
                yield CompletionChunk("c", 0, "m", 0, "a")
                await asyncio.sleep(0.05)
                self.last_sent = True
                yield CompletionChunk("c", 0, "m", 0, "", finish_reason="cancelled")

        async def write(items: AsyncIterator[CompletionChunk]) -> AsyncIterator[str]:
            try:
                async for _ in items:
                    yield "chunk"
            except ApiError as error:
                yield f"{error.status} {error.code}"

        client = SimpleNamespace(is_disconnected=lambda: asyncio.sleep(0, False))
        answer = await sse_events(state, client, [Chunks()], write)  # type: ignore[list-item]
        return [text async for text in answer.body_iterator]  # type: ignore[misc]

    assert asyncio.run(ending(600)) == ["chunk", "503 shutting_down"]
    assert asyncio.run(ending(0.01)) == ["chunk", "504 timeout"]


def stream_lines(url: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    with httpx.stream("POST", url, json=body, timeout=120) as streamed:
        return streamed.status_code, list(streamed.iter_lines())


def statuses_open(server: LiveServer) -> dict[str, str]:
    return {m["id"]: m["status"]["value"]
            for m in httpx.get(server.url + "/v1/models").json()["data"]}  # fmt: skip


def test_models_dir_serves_every_gguf(folder: Path) -> None:
    settings = parse_settings(["--models-dir", str(folder), "--n-ctx", "256", "--parallel", "1"])
    for server in _serve(settings):
        assert set(statuses_open(server)) == {"alpha", "beta", "gamma", "broken", "ranker"}
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert client.completions.create(model="beta", prompt="the", max_tokens=1).model == "beta"
        ranked = httpx.post(server.url + "/rerank", json={"model": "ranker", "query": "crab",
                                                           "documents": ["sea"]})  # fmt: skip
        assert ranked.status_code == 200


def test_a_models_folder_lists_regular_files_only(tmp_path: Path, folder: Path) -> None:
    # A FIFO or a folder named like a model, in a subfolder, was listed as a model (and the
    # subfolder as several); the scan must not wait on a FIFO either.
    shutil.copy(folder / "alpha.gguf", tmp_path / "alpha.gguf")
    (tmp_path / "sub").mkdir()
    shutil.copy(folder / "beta.gguf", tmp_path / "sub" / "beta.gguf")
    fifos = [tmp_path / "pipe.gguf", tmp_path / "sub" / "pipe.gguf"]
    for fifo in fifos:
        os.mkfifo(fifo)
    (tmp_path / "sub" / "folder.gguf").mkdir()
    found: list[Any] = []
    scan = threading.Thread(target=lambda: found.extend(scan_models_dir(tmp_path)), daemon=True)
    scan.start()
    scan.join(10)
    blocked = scan.is_alive()
    for fifo in fifos:  # let a blocked reader go
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not blocked, "the scan waited on a FIFO"
    assert [(m.name, m.path) for m in found] == [
        ("alpha", tmp_path / "alpha.gguf"),
        ("sub", tmp_path / "sub" / "beta.gguf"),
    ]


def test_a_models_folder_follows_links_but_not_back_above_itself(
    tmp_path: Path, folder: Path
) -> None:
    # ``md/up -> ..`` served every GGUF beside the folder (an adapter too) as a model; a file
    # linked to its blob (the Hugging Face cache's layout) and a subfolder linked to a snapshot
    # elsewhere are still models.
    (tmp_path / "adapter.gguf").write_bytes((folder / "beta.gguf").read_bytes())
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "gamma.gguf").symlink_to(folder / "gamma.gguf")
    md = tmp_path / "md"
    md.mkdir()
    (md / "alpha.gguf").symlink_to(folder / "alpha.gguf")
    (md / "linked").symlink_to(snapshot)
    for name, target in (("up", ".."), ("self", "."), ("root", "/")):
        (md / name).symlink_to(target)
    assert [(m.name, m.path) for m in scan_models_dir(md)] == [
        ("alpha", md / "alpha.gguf"),
        ("linked", md / "linked" / "gamma.gguf"),
    ]


def test_a_models_folder_skips_adapters(tmp_path: Path, folder: Path) -> None:
    # A LoRA beside its model was listed as a model of its own, which failed when loaded.
    shutil.copy(folder / "alpha.gguf", tmp_path / "alpha.gguf")
    tiny.write_tiny_lora(tmp_path / "alpha-lora.gguf")
    assert [m.name for m in scan_models_dir(tmp_path)] == ["alpha"]


def test_settings_of_the_multi_model_form() -> None:
    with pytest.raises(InvalidParameterError, match="not both"):
        parse_settings(["m.gguf", "--models", "x.toml"])
    with pytest.raises(InvalidParameterError, match="unknown --preset"):
        parse_settings(["m.gguf", "--preset", "tiny"])
    assert parse_settings(["--models-dir", "d", "--models-max", "2"]).multi_model
    with pytest.raises(InvalidParameterError, match="embeddings = true"):
        parse_settings(["--models", "x.toml", "--embeddings"])


def test_single_model_form_takes_a_preset(folder: Path) -> None:
    settings = ServerSettings(model=str(folder / "alpha.gguf"), preset="balanced", n_ctx=256)
    for server in _serve(settings):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert client.completions.create(model="any", prompt="the", max_tokens=1).model == (
            "alpha.gguf"  # one model answers for any name
        )
        llama = server.server.config.app.state.llamacrab.llama  # type: ignore[attr-defined]
        assert llama.context.params.n_ctx == 256 and llama.context.params.n_batch == 2048


def test_one_entry_serves_requests_that_name_no_model(folder: Path) -> None:
    config = _toml(folder / "solo.toml", f'[models.solo]\nmodel = "alpha.gguf"\n{TINY}')
    for server in _serve(ServerSettings(model="", models=config)):
        answer = httpx.post(server.url + "/v1/completions", json={"prompt": "the", "max_tokens": 1})
        assert answer.status_code == 200 and answer.json()["model"] == "solo"
        unknown = httpx.post(server.url + "/v1/completions",
                             json={"model": "gpt-4", "prompt": "the", "max_tokens": 1})  # fmt: skip
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_a_speculative_entry_serves_concurrent_requests_in_turn(folder: Path) -> None:
    # Prompt lookup needs one slot; a request arriving mid-stream must wait for the stream,
    # never cancel it (a one-slot Llama's default is to supersede).
    config = _toml(folder / "lookup.toml", f'[models.alpha]\nmodel = "alpha.gguf"\n'
                                           f"prompt_lookup = 3\n{TINY}")  # fmt: skip
    for server in _serve(ServerSettings(model="", models=config, parallel=2)):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        options: dict[str, Any] = {"model": "alpha", "max_tokens": 120, "temperature": 0,
                                   "extra_body": {"ignore_eos": True}}  # fmt: skip
        stream = iter(client.completions.create(prompt="the cat", stream=True, **options))
        first = next(stream)
        with ThreadPoolExecutor(1) as pool:
            second = pool.submit(client.completions.create, prompt="a dog", **options)
            time.sleep(0.2)  # the second request reaches the model while the stream runs
            rest = list(stream)
            assert second.result(timeout=60).choices[0].finish_reason == "length"
        chunks = [first, *rest]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(len(c.choices[0].text) > 0 for c in chunks if c.choices) > 1


# -- the serve flags as every entry's defaults ---------------------------------------------------


def test_serve_flags_are_every_entrys_defaults_under_its_own_options(folder: Path) -> None:
    from llamacrab.server._models import open_registry

    config = _toml(
        folder / "defaults.toml",
        """
[models.plain]
model = "alpha.gguf"
[models.own]
model = "beta.gguf"
n_ctx = 384
type_k = "f16"
[models.preset]
model = "gamma.gguf"
preset = "balanced"
[models.lookup]
model = "alpha.gguf"
prompt_lookup = 3
[models.ranker]
model = "ranker.gguf"
embeddings = true
pooling = "rank"
""",
    )
    settings = parse_settings(["--models", config, "--n-ctx", "320", "--n-batch", "64",
                               "--flash-attn", "off", "--cache-type-k", "bf16", "--cache-type-v",
                               "f16", "--n-threads", "1", "--preset", "low-ram",
                               "--parallel", "2"], environ={})  # fmt: skip
    registry = open_registry(settings)
    options = {name: dict(registry.entry(name).options) for name in registry.names()}
    plain = options["plain"]
    assert (plain["n_ctx"], plain["n_batch"], plain["flash_attn"]) == (320, 64, "off")
    assert (plain["type_k"], plain["type_v"], plain["n_threads"]) == ("bf16", "f16", 1)
    assert (plain["n_ubatch"], plain["parallel"]) == (128, 2)  # --preset low-ram's; the flag's
    assert (options["own"]["n_ctx"], options["own"]["type_k"]) == (384, "f16")  # its own win
    # An entry's preset is its own: it overrides the flags, its options override it.
    assert (options["preset"]["n_ctx"], options["preset"]["type_k"]) == (4096, "f16")
    assert options["lookup"]["parallel"] is None  # prompt lookup: one slot
    ranker = options["ranker"]  # no generation options on a reranker, the model flags yes
    assert "parallel" not in ranker and "media_policy" not in ranker
    assert (ranker["n_ctx"], ranker["n_batch"], registry.entry("ranker").kind) == (
        320,
        64,
        "rerank",
    )
    with registry:
        params = registry.get("plain").context.params
        assert (params.n_ctx, params.n_batch, params.n_seq_max) == (320, 64, 2)
        assert (params.flash_attn, params.type_k, params.swa_full) == ("off", "bf16", False)


def test_flags_left_at_their_defaults_yield_to_presets(folder: Path) -> None:
    from llamacrab.server._models import open_registry

    settings = parse_settings(["--models-dir", str(folder), "--preset", "low-ram"], environ={})
    options = open_registry(settings).entry("alpha").options
    # Not the server's n_batch 2048, n_ubatch 512, flash_attn auto: the preset's.
    assert (options["n_batch"], options["n_ubatch"], options["flash_attn"]) == (512, 128, "on")
    assert options["n_ctx"] == 2048
    bare = open_registry(parse_settings(["--models-dir", str(folder)], environ={}))
    assert (
        bare.entry("alpha").options["n_ctx"] == 4096
        and "n_batch" not in bare.entry("alpha").options
    )


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--lora", "a.gguf"], r"--lora: .* set lora on its entry"),
        (["--lora-scaled", "a.gguf:0.5", "--control-vector", "v.gguf"],
         r"--lora-scaled, --control-vector: .* set lora, control_vectors on its entry"),
        (["--mmproj", "p.gguf"], "set mmproj on its entry"),
        (["--model-draft", "d.gguf"], "set draft_model on its entry"),
        (["--hf-filename", "*Q4*"], "set filename on its entry"),
        (["--model-alias", "chat"], "id is its entry.s name"),
        (["--pooling", "rank"], "every embedding model a reranker"),
    ],
)  # fmt: skip
def test_flags_naming_one_models_files_are_refused_with_many(flags: list[str], match: str) -> None:
    with pytest.raises(InvalidParameterError, match=match):
        parse_settings(["--models-dir", "d", *flags], environ={})
    parse_settings(["m.gguf", *flags], environ={})  # one model: they apply to it


def test_a_body_nested_past_the_recursion_limit_names_no_model() -> None:
    # Reading its model raised RecursionError: a 500 where the one-model server says 400.
    from llamacrab.server._requested_model import requested_model as _requested_model

    assert _requested_model({"query_string": b"model=m"}, b"[" * 200_000) == "m"


def test_a_repeated_model_query_names_the_last_as_the_route_reads_it() -> None:
    # Found by an audit: the lease took the first, the route used the last (Starlette's), and
    # an isolated entry answered 500 ("not a Llama of this process").
    from llamacrab.server._requested_model import requested_model as _requested_model

    assert _requested_model({"query_string": b"model=local&model=iso"}, b"") == "iso"


def test_a_model_larger_than_the_whole_budget_is_not_a_busy_server() -> None:
    # Found by an audit: it was 503 "model_busy", which clients retry, for ever.
    from llamacrab.server._models import lease_error

    never = lease_error(ModelBudgetError("needs 2 GiB, more than the whole budget", alone=True))
    assert (never.status, never.code, never.headers) == (
        500, "model_too_large", {"x-should-retry": "false"}
    )  # fmt: skip
    busy = lease_error(ModelBudgetError("no room: each is in use"))
    assert (busy.status, busy.code, busy.headers) == (503, "model_busy", {})


def test_no_room_beside_pinned_models_is_not_a_busy_server() -> None:
    # Found by an audit: with max_loaded taken by pinned models, every other model was a 503
    # model_busy, which clients retry for ever (while /health said ok).
    from llamacrab.server._models import lease_error

    pinned = lease_error(ModelBudgetError("no room beside the pinned models", permanent=True))
    assert (pinned.status, pinned.code, pinned.headers) == (
        500, "model_blocked_by_pinned", {"x-should-retry": "false"}
    )  # fmt: skip


def test_a_pinned_model_left_without_room_is_logged(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by review: no room leaves an entry unloaded without an error, and load_pinned
    # swallowed it: /health, /v1/models and the log were silent about a pinned model.
    from llamacrab.server._models import load_pinned

    options = {"n_ctx": 256}
    one = estimate_memory(folder / "alpha.gguf", **options).total
    entries = [ModelEntry(name, str(folder / f"{name}.gguf"), options, pinned=True)
               for name in ("alpha", "beta")]  # fmt: skip
    registry = ModelRegistry(entries, memory_budget=one + one // 2, loader=lambda e: Stand())
    with caplog.at_level(logging.WARNING, logger="llamacrab.server"), registry:
        load_pinned(registry)
        deadline = time.monotonic() + 10
        while "not loaded" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "pinned model 'beta' not loaded: no room for model 'beta' beside" in caplog.text


class Stand:
    """What a loader makes of an entry, standing in for a Llama."""

    scheduler = None
    busy = False

    def cancel(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_server_of_no_model_is_refused_at_start(tmp_path: Path) -> None:
    # Found by an audit: `serve --models-dir EMPTY` ran, answering 404 to every request.
    import subprocess
    import sys

    from llamacrab._ports import free_port
    from llamacrab.server._models import open_registry

    (tmp_path / "notes.txt").write_text("no model here")
    with pytest.raises(InvalidParameterError, match=r"--models-dir .* holds no model \(it "):
        open_registry(parse_settings(["--models-dir", str(tmp_path)], environ={}))
    config = _toml(tmp_path / "none.toml", "max_loaded = 1\n")
    with pytest.raises(InvalidParameterError, match=r"none\.toml names no model"):
        open_registry(parse_settings(["--models", config], environ={}))
    run = subprocess.run([sys.executable, "-m", "llamacrab", "serve", "--models-dir",
                          str(tmp_path), "--port", str(free_port())], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 1 and run.stderr == (
        f"llamacrab: --models-dir {tmp_path} holds no model (it looks for *.gguf files in it "
        "and in its subfolders): there is nothing to serve\n"
    )


def test_props_slots_and_transcriptions_serve_the_model_a_request_names(
    folder: Path, tmp_path: Path
) -> None:
    # Found by an audit: with several models /props and /slots answered 400 "name one of" even
    # given ?model= (llama-server's router takes it), and a transcription's form field model
    # was not leased.
    config = _toml(folder / "pair.toml", f'[models.alpha]\nmodel = "alpha.gguf"\n{TINY}'
                                         f'[models.beta]\nmodel = "beta.gguf"\n{TINY}')  # fmt: skip
    settings = ServerSettings(model="", models=config, slot_save_path=str(tmp_path), props=True)
    for server in _serve(settings):
        url = server.url
        props = httpx.get(url + "/props", params={"model": "beta"})
        assert props.status_code == 200, props.text
        assert props.json()["model_alias"] == "beta"
        assert props.json()["model_path"] == str(folder / "beta.gguf")
        assert httpx.post(url + "/props?model=alpha", json={}).json() == {"success": True}
        unnamed = httpx.get(url + "/props")
        assert unnamed.status_code == 400 and "alpha, beta" in unnamed.text
        httpx.post(url + "/v1/completions", json={"model": "alpha", "prompt": "the cat",
                                                  "max_tokens": 2})  # fmt: skip
        slots = httpx.get(url + "/slots", params={"model": "alpha"})
        assert slots.status_code == 200, slots.text
        assert [s["n_prompt_tokens"] > 0 for s in slots.json()] == [True]
        action = url + "/slots/0?model=alpha&action="
        saved = httpx.post(action + "save", json={"filename": "alpha.bin"})
        assert saved.status_code == 200 and saved.json()["n_saved"] > 0, saved.text
        restored = httpx.post(action + "restore", json={"filename": "alpha.bin"})
        assert restored.json()["n_restored"] == saved.json()["n_saved"], restored.text
        assert httpx.post(action + "erase").json()["n_erased"] > 0
        # In the form, or (found by review: the route read only the form) in the query.
        for form, query in (({"model": "beta"}, ""), ({}, "?model=beta")):
            transcribed = httpx.post(url + "/v1/audio/transcriptions" + query, data=form,
                                     files={"file": ("tone.wav", b"RIFF")})  # fmt: skip
            assert transcribed.status_code == 400, transcribed.text
            assert transcribed.json()["error"]["message"].startswith(
                "model 'beta' cannot transcribe: it has no audio projector"
            )


def test_a_form_names_its_model_in_its_field() -> None:
    # Found by an audit: a form's model (a transcription's) was not read, so not leased.
    from llamacrab.server._requested_model import requested_model as _requested_model

    def form(content_type: bytes, body: bytes, query: bytes = b"") -> str | None:
        scope = {"headers": [(b"content-type", content_type)], "query_string": query}
        return _requested_model(scope, body)

    def part(disposition: str, data: bytes) -> bytes:
        return f"--b0\r\nContent-Disposition: form-data; {disposition}\r\n\r\n".encode() + data

    multipart = b"multipart/form-data; boundary=b0"
    body = (part('name="file"; filename="model"', b"model=x\r\n--b1\r\n" * 1000) + b"\r\n"
            + part('name="model"', b"first") + b"\r\n"
            + part('name="model"', "s\u00e9cond".encode()) + b"\r\n--b0--\r\n")  # fmt: skip
    assert form(multipart, body) == "s\u00e9cond"  # the last, as the route reads it; no file
    assert form(multipart, part('name="model"', b"") + b"\r\n--b0--\r\n", b"model=q") == "q"
    assert form(multipart, b"not a form at all", b"model=q") == "q"
    assert form(b"multipart/form-data", part('name="model"', b"m")) is None  # no boundary
    urlencoded = b"application/x-www-form-urlencoded"
    assert form(urlencoded, b"prompt=a&model=one&model=tw%C3%B6") == "tw\u00f6"
    assert form(b"text/plain", b"model=one") is None
    # Found by review: forms the route refuses (Starlette reads 1000 fields and 1000 files, a
    # field of 1 MiB) were read to the end on the event loop: 4M fields took 2.5 s, 200k empty
    # parts 1.4 s, while every model's requests waited. The model they name is not read.
    assert form(urlencoded, b"a&" * 4_000_000 + b"model=x") is None

    def parts(count: int) -> bytes:
        return (
            (part('name="a"', b"") + b"\r\n") * count
            + part('name="model"', b"x")
            + b"\r\n--b0--\r\n"
        )

    assert form(multipart, parts(1000)) == "x" and form(multipart, parts(3000)) is None
    assert form(multipart, part('name="model"', b"x" * (2 << 20)) + b"\r\n--b0--\r\n") is None


def _stand_ins(tiny_model_path: Path, *names: str) -> tuple[ModelRegistry, TestClient]:
    """A multi-model app (not started) over entries that load as Stands."""
    entries = [ModelEntry(name, str(tiny_model_path)) for name in names]
    registry = ModelRegistry(entries, loader=lambda entry: Stand())
    return registry, TestClient(create_app(ServerSettings(model=""), registry=registry))


def test_a_path_that_no_route_has_loads_no_model(tiny_model_path: Path) -> None:
    # Found by fuzzing: POST /v1/embeddings/ loaded the generation model it named, then
    # answered 307 to /v1/embeddings (where, sent again, the body met the kind check): a
    # model loaded, maybe evicting another, for a request it could not serve.
    registry, client = _stand_ins(tiny_model_path, "gen", "other")
    for path in ("/v1/embeddings/", "/v1/completions/", "/models/load/", "/v1/nowhere"):
        answer = client.post(path, json={"model": "gen", "input": "x"}, follow_redirects=False)
        assert answer.status_code == 404, (path, answer.text)
        assert answer.json()["error"]["code"] == "unknown_url"
    assert client.get("/v1/embeddings", params={"model": "gen"}).status_code == 405
    assert registry.status("gen").status == "unloaded"
    refused = client.post("/v1/embeddings", json={"model": "gen", "input": "x"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_not_capable"
    assert registry.status("gen").status == "unloaded"


def test_the_api_docs_load_no_model(tiny_model_path: Path) -> None:
    # Found by review: FastAPI's pages are routes too, and opening /docs loaded the only model
    # (an isolated one: a process started; a broken one: a 500 instead of the page).
    registry, client = _stand_ins(tiny_model_path, "alpha")
    for method, path in (("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/redoc"),
                         ("HEAD", "/docs"), ("GET", "/docs/oauth2-redirect")):  # fmt: skip
        assert client.request(method, path).status_code == 200, path
    assert registry.status("alpha").status == "unloaded"


def test_a_stored_response_lookup_loads_no_model(tiny_model_path: Path) -> None:
    # Found by fuzzing: ?model= on a stored response's routes leased that model, loading it
    # (an isolated one: a process started) just to answer 404; so did the only model of a
    # registry for every lookup. The loaded models alone are asked (test_server_isolation.py).
    lookups = [("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x"),
               ("GET", "/v1/responses/resp_x/input_items"), ("POST", "/responses/resp_x/cancel"),
               ("GET", "/v1/responses/input_tokens")]  # fmt: skip
    for names, query in ((("alpha", "beta"), "?model=alpha"), (("alpha",), "")):
        registry, client = _stand_ins(tiny_model_path, *names)
        for method, path in lookups:
            answer = client.request(method, path + query)
            assert answer.status_code == 404, (method, path, answer.text)
            assert answer.json()["error"]["code"] == "response_not_found"
        assert registry.status("alpha").status == "unloaded", names
    # Counting a request's input tokens needs its model.
    client.post("/v1/responses/input_tokens", json={"model": "alpha", "input": "hi"})
    assert registry.status("alpha").status == "loaded"


@pytest.mark.timeout(120)
def test_load_and_unload_never_wait_for_the_threads_every_sync_route_shares(
    tiny_model_path: Path,
) -> None:
    # Found by fuzzing: /models/load and /models/unload waited on anyio's 40 threads, which
    # every sync route shares: with those taken, a load waited until one came free.
    from anyio import to_thread

    registry, client = _stand_ins(tiny_model_path, "alpha", "beta")
    app: FastAPI = client.app  # type: ignore[assignment]
    holding, release = threading.Semaphore(0), threading.Event()

    @app.get("/hold")
    def hold() -> None:  # sync: FastAPI runs it on anyio's shared threads
        holding.release()
        release.wait(60)

    with client:  # one event loop, one pool of shared threads for every request
        shared = client.portal.call(to_thread.current_default_thread_limiter).total_tokens
        with ThreadPoolExecutor(shared + 1) as pool:
            held = [pool.submit(client.get, "/hold") for _ in range(shared)]
            try:
                assert all(holding.acquire(timeout=30) for _ in range(shared))
                loaded = pool.submit(client.post, "/models/load", json={"model": "alpha"})
                assert loaded.result(timeout=10).json()["status"]["value"] == "loaded"
                unloaded = pool.submit(client.post, "/models/unload", json={"model": "alpha"})
                assert unloaded.result(timeout=10).json()["unloaded"] is True
            finally:
                release.set()
            assert [f.result().status_code for f in held] == [200] * shared
    assert registry.status("alpha").status == "unloaded"
