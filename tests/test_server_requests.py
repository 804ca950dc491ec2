"""What a request can say, as llama-server's clients say it: -1 for no token limit, and
max_completion_tokens before max_tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import LiveServer
from test_tool_calls import TEMPLATE

from llamacrab import Llama
from llamacrab.server import ServerSettings

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
LIMIT = 20  # the server's --max-tokens-limit (above /v1/completions' default of 16)
CHAT = [{"role": "user", "content": "the cat"}]
GREEDY = {"temperature": 0}
FIRST: dict[str, dict[str, Any]] = {  # what each route needs besides the fields tested
    "/v1/completions": {"prompt": "the cat"},
    "/v1/chat/completions": {"messages": CHAT},
    "/completion": {"prompt": "the cat"},
}


def _running(settings: ServerSettings) -> Iterator[LiveServer]:
    server = LiveServer(settings)
    try:
        assert server.wait_until_loaded() == 200
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("requests") / "tiny.gguf"
    path: Path = tiny.write_tiny_llama(out, chat_templates={"": TEMPLATE})
    return path


@pytest.fixture(scope="module")
def server(tiny_path: Path) -> Iterator[LiveServer]:
    settings = ServerSettings(model=str(tiny_path), n_ctx=512, max_tokens_limit=LIMIT, max_n=4)
    yield from _running(settings)


@pytest.fixture(scope="module")
def llama(tiny_path: Path) -> Iterator[Llama]:
    with Llama(tiny_path, n_ctx=512, n_threads=2) as model:
        yield model


def post(server: LiveServer, route: str, body: dict[str, Any]) -> Any:
    answer = httpx.post(server.url + route, json={**GREEDY, **body}, timeout=60)
    assert answer.status_code == 200, (body, answer.text)
    return answer.json()


def refused(server: LiveServer, route: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(server.url + route, json={**GREEDY, **body}, timeout=60)
    assert answer.status_code == 400, (body, answer.text)
    error: dict[str, Any] = answer.json()["error"]
    return error


def generated(server: LiveServer, route: str, body: dict[str, Any]) -> int:
    """How many tokens the answer to ``body`` on ``route`` generated."""
    answer = post(server, route, {**FIRST[route], **body})
    usage = answer.get("usage")  # /completion's answer has none
    return int(answer["tokens_predicted"] if usage is None else usage["completion_tokens"])


# -- how many tokens -----------------------------------------------------------------------------


ROUTES = ["/v1/completions", "/v1/chat/completions", "/completion"]


@pytest.mark.parametrize("route", ROUTES)
def test_minus_one_means_no_limit_but_the_servers(server: LiveServer, route: str) -> None:
    # Clients of llama-server send -1 for "no limit" (the tiny model runs to any limit).
    names = ["max_tokens", "max_completion_tokens"] if "chat" in route else ["max_tokens"]
    for name in names:
        assert generated(server, route, {name: -1}) == LIMIT, name
        assert refused(server, route, {**FIRST[route], name: -2})["param"] == name


def test_max_completion_tokens_wins_over_max_tokens(server: LiveServer) -> None:
    # OpenAI deprecates max_tokens for it; llama-server reads it first too.
    route = "/v1/chat/completions"
    assert generated(server, route, {"max_tokens": 3, "max_completion_tokens": 5}) == 5
    assert generated(server, route, {"max_tokens": 5, "max_completion_tokens": 3}) == 3
