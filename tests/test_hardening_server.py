"""Server hardening: bounded stop lists, /metrics labels clients cannot grow or forge, no
redirect of a path with a trailing slash, and one JSON spelling of every error."""

from __future__ import annotations

import json
import random
import re
import string
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from llamacrab import ModelEntry, ModelRegistry
from llamacrab.server import ServerSettings
from llamacrab.server._app import create_app
from llamacrab.server._metrics import Metrics, escape_label
from llamacrab.server._schemas import MAX_STOP_CHARS, MAX_STOP_STRINGS

# One line of Prometheus' text exposition format: a comment, or a sample whose label values
# hold only escaped backslashes, quotes and line feeds.
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(
    rf"[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{{{_LABEL}(?:,{_LABEL})*\}})? [-+0-9.eEinfaINFA]+"
)
_COMMENT = re.compile(r"# (?:HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .*")


@pytest.fixture
def client() -> TestClient:
    # Not entered as a context manager: no lifespan, so no model loads; routes answer 503, and
    # request validation (400) happens before that.
    return TestClient(create_app(ServerSettings(model="absent.gguf")))


def _routes(metrics_text: str) -> set[str]:
    return set(re.findall(r'llamacrab_requests_total\{route="((?:[^"\\]|\\.)*)"', metrics_text))


def _assert_parses(metrics_text: str) -> None:
    assert metrics_text.endswith("\n")
    for line in metrics_text[:-1].split("\n"):
        assert _COMMENT.fullmatch(line) or _SAMPLE.fullmatch(line), line


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_too_many_stop_strings_are_refused(client: TestClient, endpoint: str) -> None:
    body: dict[str, object] = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    answer = client.post(endpoint, json={**body, "stop": ["x"] * (MAX_STOP_STRINGS + 1)})
    assert answer.status_code == 400
    assert f"at most {MAX_STOP_STRINGS} strings" in answer.json()["error"]["message"]
    long = "y" * (MAX_STOP_CHARS + 1)
    for stop in (long, ["a", long]):
        answer = client.post(endpoint, json={**body, "stop": stop})
        assert answer.status_code == 400
        assert f"at most {MAX_STOP_CHARS} characters" in answer.json()["error"]["message"]
    # At the limits the request passes validation (and finds no model loaded).
    ok = {**body, "stop": ["z" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}
    assert client.post(endpoint, json=ok).status_code == 503


def test_metrics_label_routes_by_template_not_by_request_path(client: TestClient) -> None:
    client.get("/v1/foo%22%0Abad")
    client.get('/v1/foo"\\bar')
    rng = random.Random(7)
    for _ in range(200):
        client.get("/" + "".join(rng.choices(string.ascii_letters + "%\"'\\{}", k=12)))
    client.get("/v1/models")
    client.post("/v1/chat/completions", json={"messages": []})
    text = client.get("/metrics").text
    _assert_parses(text)
    assert _routes(text) == {"unmatched", "/v1/models", "/v1/chat/completions"}
    assert "bad" not in text and "foo" not in text
    assert 'llamacrab_requests_total{route="unmatched",status="404"} 202' in text


def test_label_values_are_escaped() -> None:
    assert escape_label('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    metrics = Metrics()
    metrics.request_done('/x"}\nllamacrab_forged 1\n\\', 200, 0.1)
    text = metrics.render(0, 0, 0)
    _assert_parses(text)
    assert "\nllamacrab_forged" not in text


# Valid for Python's json module, not for JSON (RFC 8259): llama-server's parser refuses them.
@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b'{"prompt": "\\ud800"}', "unpaired surrogate '\\ud800'"),
        (b'{"prompt": "hi", "stop": ["\\udc00"]}', "unpaired surrogate '\\udc00'"),
        (b'{"prompt": "hi", "temperature": NaN}', "NaN is not a JSON value"),
        (b'{"prompt": "hi", "temperature": Infinity}', "Infinity is not a JSON value"),
        (b'{"prompt": "hi", "logit_bias": {"1": -Infinity}}', "-Infinity is not a JSON value"),
        (b'{"prompt": "hi", "temperature": 1e999}', "1e999 is beyond a double's range"),
    ],
)
def test_a_body_only_python_parses_is_refused_as_json_names_it(
    client: TestClient, raw: bytes, problem: str
) -> None:
    # The surrogate reached the tokenizer's UTF-8 encoding: a plain-text 500 on every text route.
    answer = client.post("/v1/completions", content=raw,
                         headers={"content-type": "application/json"})  # fmt: skip
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert message.startswith("the request body is not valid JSON: ") and problem in message
    anthropic = client.post("/v1/messages", content=raw)  # no content type: parsed as JSON too
    assert anthropic.status_code == 400
    assert anthropic.json()["type"] == "error" and problem in anthropic.json()["error"]["message"]


def test_a_body_nested_past_the_parser_says_so(client: TestClient) -> None:
    # FastAPI answered "There was an error parsing the body", naming nothing.
    raw = b'{"prompt": "hi", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    headers = {"content-type": "application/json"}
    for route, shape in (("/v1/completions", "openai"), ("/v1/messages", "anthropic")):
        answer = client.post(route, content=raw, headers=headers)
        assert answer.status_code == 400, answer.text
        body = answer.json()
        assert (body.get("type") == "error") is (shape == "anthropic")
        assert "nests deeper than this server reads" in body["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code != 500


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "\\ud83d\\ude00 NaN Infinity \\\\ud800", "temperature": 1e300}',
        b'{"prompt": "hi", "max_tokens": 1E+308}',
    ],
)
def test_json_that_only_looks_suspect_passes(client: TestClient, raw: bytes) -> None:
    # A surrogate pair, the words inside a string, an escaped backslash, a finite exponent.
    answer = client.post("/v1/completions", content=raw,
                         headers={"content-type": "application/json"})  # fmt: skip
    assert "not valid JSON" not in answer.text


def test_an_unexpected_error_is_a_json_500_in_the_shape_of_its_api() -> None:
    app = create_app(ServerSettings(model="absent.gguf"))

    async def broken() -> None:
        raise RuntimeError("a bug")

    for path in ("/test/broken", "/v1/messages/broken"):
        app.add_api_route(path, broken, methods=["GET"])
    client = TestClient(app, raise_server_exceptions=False)
    openai = client.get("/test/broken")
    assert openai.status_code == 500
    assert openai.json()["error"]["message"] == "internal server error: RuntimeError: a bug"
    anthropic = client.get("/v1/messages/broken")
    assert anthropic.status_code == 500
    assert anthropic.json() == {"type": "error", "error": {
        "type": "api_error", "message": "internal server error: RuntimeError: a bug"}}  # fmt: skip


@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        ({"k": "v" * 513}, "metadata.k: String should have at most 512 characters"),
        ({"k" * 65: "v"}, "[key]: String should have at most 64 characters"),
        ({str(i): "v" for i in range(17)}, "metadata: Dictionary should have at most 16 items"),
    ],
)
def test_responses_metadata_has_openais_bounds(
    client: TestClient, metadata: dict[str, str], problem: str
) -> None:
    # Kept with a stored response for an hour: 60 requests of 7 MiB grew the server by 460 MiB.
    answer = client.post("/v1/responses", json={"input": "hi", "metadata": metadata})
    assert answer.status_code == 400 and problem in answer.json()["error"]["message"]
    at_limits = {str(i).rjust(64, "k"): "v" * 512 for i in range(16)}
    answer = client.post("/v1/responses", json={"input": "hi", "metadata": at_limits})
    assert answer.status_code == 503  # valid: it finds no model loaded


@pytest.mark.parametrize(
    "content_type", [None, "application/x-www-form-urlencoded", "text/plain;charset=UTF-8"]
)
def test_a_json_body_not_declared_so_is_refused_naming_its_content_type(
    client: TestClient, content_type: str | None
) -> None:
    # What `curl -d` and a web page's plain POST send: never parsed, since a browser posts the
    # plain types to any server on the machine without asking CORS first.
    headers = {"Content-Type": content_type} if content_type else {}
    answer = client.post("/completion", content=b'{"prompt": "hi"}', headers=headers)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert "not read as JSON" in message and repr(content_type or "missing") in message
    assert "application/json" in message
    # A declared JSON body that is wrong is still refused field by field.
    wrong = client.post("/completion", json={"prompt": 3.5})
    assert wrong.status_code == 400 and "not read as JSON" not in wrong.json()["error"]["message"]
    vendor = client.post("/completion", content=b'{"prompt": "hi"}',
                         headers={"Content-Type": "application/vnd.api+json"})  # fmt: skip
    assert vendor.status_code == 503  # read as JSON; no model is loaded


def test_null_for_a_field_with_a_default_is_the_default(client: TestClient) -> None:
    # OpenAI's optional fields are nullable and llama-server reads null as absent: clients that
    # serialize every field send them so (a 400 before).
    unset = {"n": None, "stream": None, "temperature": None, "stop": None, "seed": None}
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": None, **unset}
    native = {"prompt": "hi", "ignore_eos": None, "cache_prompt": None, "return_tokens": None}
    for path, body in (
        ("/v1/chat/completions", chat),
        ("/v1/completions", {"prompt": "hi", "echo": None, **unset}),
        ("/completion", {**native, **unset}),
        ("/v1/responses", {"input": "hi", "store": None, "stream": None}),
    ):
        answer = client.post(path, json=body)
        assert answer.status_code == 503, (path, answer.text)  # valid; no model is loaded
    # A required field is still required.
    for path, body in (
        ("/v1/chat/completions", {"messages": None}),
        ("/completion", {"prompt": None}),
    ):
        assert client.post(path, json=body).status_code == 400, path


def test_a_path_with_a_trailing_slash_is_a_404_naming_it_never_a_redirect(
    client: TestClient,
) -> None:
    # Found by fuzzing: POST /v1/embeddings/ answered 307 to /v1/embeddings, which clients
    # follow by sending the body again. llama-server matches paths exactly: its 404.
    app: FastAPI = client.app  # type: ignore[assignment]
    routes = [(r.path, method) for r in app.routes if isinstance(r, APIRoute)
              and "{" not in r.path for method in r.methods]  # fmt: skip
    assert ("/v1/embeddings", "POST") in routes and ("/health", "GET") in routes
    for path, method in routes:
        answer = client.request(method, path + "/", follow_redirects=False)
        assert answer.status_code == 404, (method, path, answer.status_code)
        if method == "HEAD":  # an answer without a body
            continue
        error = answer.json()["error"]
        if path == "/v1/models":  # /v1/models/{model_id}, of no id
            assert error["code"] == "model_not_found"
            continue
        assert (error["code"], error["message"]) == (
            "unknown_url", f"unknown request URL: {method} {path}/ (no route ends with a slash)"
        )  # fmt: skip
    anthropic = client.post("/v1/messages/", json={}, follow_redirects=False)
    assert anthropic.status_code == 404 and anthropic.json()["error"]["type"] == "not_found_error"
    unknown = client.get("/v1/nowhere").json()["error"]
    assert unknown["message"] == "unknown request URL: GET /v1/nowhere"


def test_a_wrong_method_names_the_allowed_ones_and_health_answers_head(
    client: TestClient,
) -> None:
    # A 405 must carry Allow (RFC 9110); the error handler rebuilt it without its headers.
    # llama-server answers HEAD on its GET routes: a `curl -I` health check got 405 here.
    wrong = client.post("/health")
    assert wrong.status_code == 405 and "GET" in wrong.headers["allow"]
    for path in ("/health", "/v1/health"):
        assert client.head(path).status_code == client.get(path).status_code != 405


def _compact(answer: object) -> bytes:
    return json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode()


def test_every_error_is_written_in_one_json_spelling(tiny_model_path: Path) -> None:
    # Found by fuzzing: the middlewares wrote their errors with spaces after the separators and
    # non-ASCII escaped, the routes and handlers compact: two spellings of one error shape.
    key = {"authorization": "Bearer k"}
    one = TestClient(create_app(ServerSettings(model="absent.gguf", api_keys=("k",),
                                               max_body_bytes=1000)))  # fmt: skip
    registry = ModelRegistry([ModelEntry(name, str(tiny_model_path)) for name in ("gen", "other")])
    several = TestClient(create_app(ServerSettings(model=""), registry=registry))
    as_json = {**key, "content-type": "application/json"}
    answers = {
        "no key": one.get("/v1/models"),
        "no key, Anthropic's": one.post("/v1/messages", json={}),
        "too large": one.post("/v1/completions", content=b"x" * 2000, headers=key),
        "not JSON": one.post("/v1/completions", content=b'{"prompt": NaN}', headers=as_json),
        "invalid": one.post("/v1/completions", json={"n": "\u00e9"}, headers=key),
        "invalid, Anthropic's": one.post("/v1/messages", json={"model": "m"}, headers=key),
        "route": one.get("/v1/models/caf\u00e9", headers=key),
        "unknown model": several.post("/v1/completions", json={"model": "caf\u00e9"}),
        "incapable model": several.post("/v1/embeddings", json={"model": "gen", "input": "x"}),
    }
    for why, answer in answers.items():
        assert answer.status_code >= 400, why
        assert answer.content == _compact(answer.json()), why
        assert answer.headers["content-type"] == "application/json", why
    assert "caf\u00e9" in answers["unknown model"].text  # UTF-8, not escaped
    assert answers["no key"].headers["www-authenticate"] == "Bearer"
    assert answers["no key, Anthropic's"].json()["type"] == "error"
