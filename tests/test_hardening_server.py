"""Server hardening: bounded stop lists, and /metrics labels clients cannot grow or forge."""

from __future__ import annotations

import random
import re
import string

import pytest
from fastapi.testclient import TestClient

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
