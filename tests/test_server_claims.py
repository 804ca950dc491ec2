"""Claims of the README and SECURITY.md that nothing else tests: CORS off and --cors-origin, SSE
ending in ``data: [DONE]`` (after an error too), /health 503 while the model loads, the body limit
on a streamed (chunked) body, request ids, and silence when logging is not configured."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from live_server import LiveServer, running

from llamacrab import Llama
from llamacrab.server import ServerSettings, parse_settings
from llamacrab.server import _state as server_state
from llamacrab.server._app import create_app
from llamacrab.server._errors import ApiError

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
mmproj = load_repo_module("scripts/make_tiny_mmproj.py")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tiny.write_tiny_llama(tmp_path_factory.mktemp("claims") / "tiny.gguf")
    return path


@pytest.fixture(scope="module")
def server(tiny_path: Path) -> Iterator[LiveServer]:
    """Chat through chatml, and a 4 KiB body limit."""
    yield from running(ServerSettings(model=str(tiny_path), chat_template="chatml", n_ctx=2048,
                                       n_threads=1, max_body_bytes=4096))  # fmt: skip


@pytest.fixture(scope="module")
def hasty_server(tiny_path: Path) -> Iterator[LiveServer]:
    """A timeout (50 ms) that no long generation meets."""
    yield from running(ServerSettings(model=str(tiny_path), chat_template="chatml", n_ctx=2048,
                                       n_threads=1, timeout=0.05))  # fmt: skip


# -- CORS ----------------------------------------------------------------------------------------

ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip


def _cors_headers(response: httpx.Response) -> set[str]:
    return {k for k in response.headers if k.lower().startswith("access-control-")}


def _app(**settings: Any) -> TestClient:
    # No lifespan: nothing loads; /v1/models answers, generating routes answer 503.
    return TestClient(create_app(ServerSettings(model="absent.gguf", **settings)))


def test_cors_is_off_by_default_on_every_kind_of_answer() -> None:
    client = _app(api_keys=("k",))
    key = {"Authorization": "Bearer k", "Origin": ORIGIN}
    answers = [
        client.get("/v1/models", headers=key),  # 200
        client.get("/v1/models", headers={"Origin": ORIGIN}),  # 401
        client.post("/v1/completions", headers=key, json={"prompt": "hi"}),  # 503: not loaded
        client.post("/v1/completions", headers=key, json={"prompt": 5}),  # 400
        client.get("/nowhere", headers=key),  # 404
        client.options("/v1/chat/completions", headers=PREFLIGHT),  # a preflight
    ]
    assert [a.status_code for a in answers][:5] == [200, 401, 503, 400, 404]
    assert answers[5].status_code < 400  # answered, not refused (no key needed)
    for answer in answers:
        assert _cors_headers(answer) == set(), (answer.request.url, answer.headers)


def test_cors_origin_flags_allow_those_origins_only() -> None:
    settings = parse_settings(["m.gguf", "--cors-origin", ORIGIN, "--cors-origin",
                               "https://b.example"], {})  # fmt: skip
    assert settings.cors_origins == (ORIGIN, "https://b.example")
    from_env = parse_settings(["m.gguf"], {"LLAMACRAB_CORS_ORIGIN": f"{ORIGIN}, https://b.example"})
    assert from_env.cors_origins == settings.cors_origins
    assert parse_settings(["m.gguf"], {}).cors_origins == ()  # off unless asked for

    client = _app(api_keys=("k",), cors_origins=settings.cors_origins)
    key = {"Authorization": "Bearer k"}
    for origin in (ORIGIN, "https://b.example"):
        ok = client.get("/v1/models", headers={**key, "Origin": origin})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin
        preflight = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": origin})
        assert preflight.status_code == 200  # no key on a preflight, and no 401 for it
        assert preflight.headers["access-control-allow-origin"] == origin
        assert "POST" in preflight.headers["access-control-allow-methods"]
    other = client.get("/v1/models", headers={**key, "Origin": "https://evil.example"})
    assert other.status_code == 200 and _cors_headers(other) == set()

    anyone = _app(cors_origins=("*",))
    for origin in (ORIGIN, "http://localhost:3000"):
        answer = anyone.get("/v1/models", headers={"Origin": origin})
        assert answer.headers["access-control-allow-origin"] in ("*", origin)


# -- request ids ---------------------------------------------------------------------------------


def _boom() -> None:
    raise RuntimeError("a bug")


def test_every_answer_names_its_request_where_the_sdks_read_it() -> None:
    client = _app(api_keys=("k",), cors_origins=(ORIGIN,))
    key = {"Authorization": "Bearer k"}
    answers = [
        client.get("/v1/models", headers=key),  # 200
        client.get("/v1/models"),  # 401, refused before any route
        client.get("/nowhere", headers=key),  # 404
        client.options("/v1/completions", headers=PREFLIGHT),  # a preflight
    ]
    ids = [answer.headers["x-request-id"] for answer in answers]
    assert [answer.headers["request-id"] for answer in answers] == ids  # Anthropic's name
    assert all(re.fullmatch("req_[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids)

    # A proxy's id is kept; one that is not a plain token is replaced.
    kept = client.get("/v1/models", headers={**key, "X-Request-Id": "edge-7f3a:12"})
    assert kept.headers["x-request-id"] == kept.headers["request-id"] == "edge-7f3a:12"
    for bad in ("two words", "x" * 129, "semi;colon"):
        answer = client.get("/v1/models", headers={**key, "X-Request-Id": bad})
        assert re.fullmatch("req_[0-9a-f]{32}", answer.headers["x-request-id"]), bad

    # A bug's 500 too: Starlette answers it outside every middleware.
    app = create_app(ServerSettings(model="absent.gguf"))
    for path in ("/boom", "/v1/messages/boom"):
        app.add_api_route(path, _boom)
    crashed = TestClient(app, raise_server_exceptions=False).get(
        "/v1/messages/boom", headers={"X-Request-Id": "edge-1"}
    )
    assert crashed.status_code == 500 and crashed.json()["type"] == "error"  # Anthropic's shape
    assert crashed.headers["x-request-id"] == crashed.headers["request-id"] == "edge-1"
    crashed = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert re.fullmatch("req_[0-9a-f]{32}", crashed.headers["x-request-id"])

    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client)
    page = sdk.models.with_raw_response.list()
    assert page.request_id is not None and page.request_id.startswith("req_")
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=client,
                      max_retries=0).models.list()  # fmt: skip
    assert refused.value.request_id is not None and refused.value.request_id.startswith("req_")
    claude = anthropic.Anthropic(base_url="http://testserver", api_key="k", http_client=client)
    assert claude.models.with_raw_response.list().request_id.startswith("req_")


def test_a_bugs_500_carries_the_cors_headers_of_the_other_answers() -> None:
    # Starlette answers it outside every middleware: a browser saw a CORS failure, not the 500.
    browser = {"Origin": ORIGIN}
    for origins, regex in (((ORIGIN,), None), (("*",), None), ((), r"https://app\.example")):
        app = create_app(ServerSettings(model="absent.gguf", cors_origins=origins,
                                        cors_origin_regex=regex))  # fmt: skip
        app.add_api_route("/boom", _boom)
        client = TestClient(app, raise_server_exceptions=False)
        crashed = client.get("/boom", headers=browser)
        assert crashed.status_code == 500 and "a bug" in crashed.json()["error"]["message"]
        assert crashed.headers["access-control-allow-origin"] in (ORIGIN, "*"), origins
        assert "Origin" in crashed.headers["vary"]
        assert _cors_headers(client.get("/boom")) == set()  # no Origin: no CORS headers
        if origins != ("*",):
            other = client.get("/boom", headers={"Origin": "https://evil.example"})
            assert other.status_code == 500 and _cors_headers(other) == set()
    off = create_app(ServerSettings(model="absent.gguf"))
    off.add_api_route("/boom", _boom)
    crashed = TestClient(off, raise_server_exceptions=False).get("/boom", headers=browser)
    assert crashed.status_code == 500 and _cors_headers(crashed) == set()


def test_errors_that_would_repeat_tell_the_sdks_not_to_retry() -> None:
    client = _app()  # nothing loads: the generating routes answer 503 "still loading"
    loading = client.post("/v1/completions", json={"prompt": "hi"})
    assert loading.status_code == 503 and "x-should-retry" not in loading.headers
    state = client.app.state.llamacrab  # type: ignore[attr-defined]
    state.error = "no such file"
    message = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/messages", message)):
        failed = client.post(path, json=body)
        assert failed.status_code == 503 and "failed to load" in failed.text
        assert failed.headers["x-should-retry"] == "false", path
    repeatable = [ApiError(500, "a bug"), ApiError(501, "unsupported"),
                  ApiError(504, "slow", code="timeout")]  # fmt: skip
    assert all(e.headers == {"x-should-retry": "false"} for e in repeatable)
    transient = [ApiError(503, "busy", code="server_busy"), ApiError(502, "child died"),
                 ApiError(409, "slot busy"), ApiError(400, "bad")]  # fmt: skip
    assert all(e.headers == {} for e in transient)


# -- server-sent events --------------------------------------------------------------------------


def _events(response: httpx.Response) -> list[str]:
    """The data of each event, in order; each event a ``data:`` line and a blank line."""
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("\n\n")
    blocks = response.text[:-2].split("\n\n")
    assert all(block.startswith("data: ") and "\n" not in block for block in blocks), blocks
    return [block.removeprefix("data: ") for block in blocks]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_ends_with_done_once_and_after_an_error_too(
    server: LiveServer, hasty_server: LiveServer, route: str
) -> None:
    body: dict[str, Any] = {"prompt": "the cat", "stream": True}
    if route.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "the cat"}], "stream": True}
    # Whole: chunks, the last with its finish reason, then [DONE] once.
    response = httpx.post(server.url + route, json={**body, "max_tokens": 4}, timeout=60)
    events = _events(response)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    # Past the server's timeout mid-way: an error event, then [DONE] all the same.
    long = {**body, "max_tokens": 1900, "min_tokens": 1900}
    response = httpx.post(hasty_server.url + route, json=long, timeout=60)
    assert response.status_code == 200
    events = _events(response)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    error = json.loads(events[-2])
    assert error["error"]["code"] == "timeout", error


# -- /health while loading -----------------------------------------------------------------------


def test_health_answers_503_while_the_model_loads(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, loading = threading.Event(), threading.Event()
    real_open = server_state.open_llama

    def slow_open(settings: ServerSettings) -> Llama:
        loading.set()
        assert release.wait(timeout=30)
        return real_open(settings)

    monkeypatch.setattr(server_state, "open_llama", slow_open)
    settings = ServerSettings(model=str(tiny_path), n_ctx=256, n_threads=1)
    with TestClient(create_app(settings)) as client:  # the lifespan starts the load
        assert loading.wait(timeout=30)
        health = client.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "loading"
        assert client.get("/v1/models").status_code == 200  # needs no model
        release.set()
        for _ in range(3000):
            if (health := client.get("/health")).status_code != 503:
                break
            threading.Event().wait(0.01)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200


# -- the body limit, streamed --------------------------------------------------------------------


def test_a_streamed_body_past_the_limit_is_refused(server: LiveServer) -> None:
    def chunked(size: int) -> Iterator[bytes]:
        """A JSON body of about ``size`` bytes (mostly blanks), sent chunked: no Content-Length
        to check."""
        yield b'{"prompt": "the cat", "max_tokens": 1'
        for _ in range(size // 512):
            yield b" " * 512
        yield b"}"

    url = server.url + "/v1/completions"
    headers = {"Content-Type": "application/json"}
    big = httpx.post(url, content=chunked(8192), headers=headers)
    assert big.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in big.request.headers
    assert big.status_code == 413 and "exceeds 4096 bytes" in big.json()["error"]["message"]
    small = httpx.post(url, content=chunked(1024), headers=headers)
    assert small.status_code == 200  # under the limit, chunked bodies are read as usual
    assert httpx.get(server.url + "/health").status_code == 200


# -- silence -------------------------------------------------------------------------------------

# Loads a model, generates, embeds, decodes an image, fails a load: all that prints nothing
# unless the program configures logging (then llama.cpp's lines reach its handler).
_CHILD = textwrap.dedent("""\
    import logging, sys
    import numpy as np
    if sys.argv[1] == "configured":
        logging.basicConfig(level=logging.DEBUG)
    from llamacrab import Image, Llama, LlamaError
    text, vision, missing = sys.argv[2:5]
    with Llama(text, n_ctx=256, n_threads=1, mmproj=vision) as llm:
        llm.create_completion("the cat", max_tokens=4)
        pixels = np.zeros((40, 50, 3), dtype=np.uint8)
        llm.create_completion(f"look {llm.media_marker} now", media=[Image(pixels=pixels)],
                              max_tokens=2)
    with Llama(text, n_ctx=128, n_threads=1, parallel=2) as llm:
        llm.create_completion("the cat", max_tokens=4)
    try:
        Llama(missing)
    except LlamaError:
        pass
""")


def test_nothing_is_printed_unless_logging_is_configured(tmp_path: Path) -> None:
    text = tiny.write_tiny_llama(tmp_path / "text.gguf")
    vision = mmproj.write_tiny_vision_mmproj(tmp_path / "vision.gguf")
    args = [str(text), str(vision), str(tmp_path / "missing.gguf")]

    def run(mode: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([sys.executable, "-c", _CHILD, mode, *args], text=True,
                                capture_output=True, timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    quiet = run("unconfigured")
    assert quiet.stdout == "" and quiet.stderr == ""
    loud = run("configured")  # the same run does log, to the handler it is given
    assert "llamacrab" in loud.stderr and "llama_model_loader" in loud.stderr


# -- found by schemathesis -----------------------------------------------------------------------


def test_token_ids_past_64_bits_are_refused_not_a_server_error(server: LiveServer) -> None:
    huge, low = 10**30, -(10**30)
    cases = [("/detokenize", {"tokens": [5, huge]}), ("/extras/detokenize", {"tokens": [low]}),
             ("/v1/completions", {"prompt": [huge], "max_tokens": 1}),
             ("/tokenize", {"content": ["the", huge]})]  # fmt: skip
    for route, body in cases:
        answer = httpx.post(server.url + route, json=body)
        assert answer.status_code == 400, (route, answer.text)
        assert "outside the vocabulary" in answer.json()["error"]["message"], (route, answer.text)
