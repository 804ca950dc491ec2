"""llama-server's fields for code completion and streaming, on every route that reads them
(/completion, /infill, /v1/completions, /v1/chat/completions): ``n_indent``,
``t_max_predict_ms`` and ``timings_per_token``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live_server import LiveServer, running

from llamacrab.server import ServerSettings

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
ROUTES: dict[str, dict[str, Any]] = {  # what each route needs besides the fields tested
    "/completion": {"prompt": "the cat"},
    "/infill": {"input_prefix": "the cat", "input_suffix": "the mat"},
    "/v1/completions": {"prompt": "the cat"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "the cat"}]},
}
# Lines indented 0 (the first: exempt), 4 and 2 spaces, then 0.
INDENTED = r'root ::= "a\n    b\n  c\nd"'
LINES = r'root ::= ("x\n"){40}'  # 80 tokens: far more than a millisecond of generating
TIMINGS = {f"{part}_{name}" for part in ("prompt", "predicted")
           for name in ("n", "ms", "per_token_ms", "per_second")} | {"cache_n"}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = tiny.write_tiny_llama(tmp_path_factory.mktemp("fields") / "tiny.gguf", fim=True,
                                 chat_templates={"": TEMPLATE})  # fmt: skip
    yield from running(ServerSettings(model=str(path), n_ctx=1024, max_tokens_limit=200))


def post(server: LiveServer, route: str, body: dict[str, Any]) -> httpx.Response:
    full = {**ROUTES[route], "temperature": 0, "max_tokens": 200, **body}
    return httpx.post(server.url + route, json=full, timeout=60)


def answer(server: LiveServer, route: str, **body: Any) -> tuple[str, str]:
    """The answer's text and how it ended (OpenAI's finish_reason, or llama-server's
    stop_type on its own routes)."""
    response = post(server, route, body)
    assert response.status_code == 200, response.text
    got = response.json()
    if "choices" not in got:
        return got["content"], got["stop_type"]
    choice = got["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["finish_reason"]


def events(server: LiveServer, route: str, **body: Any) -> list[dict[str, Any]]:
    """A streamed answer's events, ``[DONE]`` left out."""
    full = {**ROUTES[route], "temperature": 0, "max_tokens": 200, "stream": True, **body}
    with httpx.stream("POST", server.url + route, json=full, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def limit(route: str) -> str:
    return "length" if route.startswith("/v1/") else "limit"


@pytest.mark.parametrize("route", ROUTES)
def test_n_indent_cuts_the_first_line_indented_less(server: LiveServer, route: str) -> None:
    whole, ended = answer(server, route, grammar=INDENTED)
    assert whole == "a\n    b\n  c\nd" and ended != limit(route)
    # As llama-server: the line "  c" ends it, cut after its spaces; the first line is exempt.
    assert answer(server, route, grammar=INDENTED, n_indent=4) == ("a\n    b\n  ", limit(route))
    assert answer(server, route, grammar=INDENTED, n_indent=2) == ("a\n    b\n  c\n", limit(route))
    assert answer(server, route, grammar=INDENTED, n_indent=0)[0] == whole


def test_a_streamed_answer_is_cut_as_a_whole_one(server: LiveServer) -> None:
    streamed = events(server, "/completion", grammar=INDENTED, n_indent=4)
    assert "".join(e["content"] for e in streamed if not e["stop"]) == "a\n    b\n  "
    assert streamed[-1]["stop_type"] == "limit"


@pytest.mark.parametrize("route", ROUTES)
def test_t_max_predict_ms_ends_at_a_newline_past_the_limit(server: LiveServer, route: str) -> None:
    unlimited = answer(server, route, grammar=LINES)
    whole = unlimited[0]
    assert whole == "x\n" * 40 and unlimited[1] != limit(route)
    # 1 ms is over long before 80 tokens are out: the answer ends at the newline after it.
    text, ended = answer(server, route, grammar=LINES, t_max_predict_ms=1)
    assert ended == limit(route) and text.endswith("\n") and len(text) < len(whole)
    assert whole.startswith(text)
    for off in (0, -1):  # as llama-server: no limit
        assert answer(server, route, grammar=LINES, t_max_predict_ms=off) == unlimited


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("field", "value"),
    [("n_indent", -1), ("n_indent", 2**31), ("t_max_predict_ms", -2), ("t_max_predict_ms", 1.5)],
)
def test_bad_values_are_refused(server: LiveServer, route: str, field: str, value: Any) -> None:
    response = post(server, route, {field: value, "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


@pytest.mark.parametrize("route", ROUTES)
def test_timings_per_token_puts_timings_on_every_streamed_token(
    server: LiveServer, route: str
) -> None:
    grammar = r'root ::= "abcdef"'  # six tokens of one character each, then the grammar's end

    def counted(**body: Any) -> list[int]:
        timed = [e["timings"] for e in events(server, route, grammar=grammar, **body)
                 if "timings" in e]  # fmt: skip
        assert all(set(t) == TIMINGS for t in timed)
        assert len({(t["cache_n"], t["prompt_n"], t["prompt_ms"]) for t in timed}) == 1
        return [t["predicted_n"] for t in timed]

    assert counted() == [6]  # the last event's alone
    assert counted(timings_per_token=True) == [1, 2, 3, 4, 5, 6, 6]


@pytest.mark.parametrize("route", ["/completion", "/infill"])
def test_generation_settings_say_whether_timings_come_per_token(
    server: LiveServer, route: str
) -> None:
    for asked in (False, True):
        response = post(server, route, {"max_tokens": 1, "timings_per_token": asked})
        assert response.json()["generation_settings"]["timings_per_token"] is asked
    props = httpx.get(server.url + "/props").json()
    assert props["default_generation_settings"]["params"]["timings_per_token"] is False
