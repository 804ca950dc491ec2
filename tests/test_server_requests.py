"""What a request can say, as llama-server's clients say it: the token limit's names and -1,
llama-server's own fields on the OpenAI routes, logit_bias in its forms, several prompts in one
/v1/completions request, /completion's prompt object (with images), and /apply-template's
add_generation_prompt."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import LiveServer, running
from test_multimodal import IMAGE_TOKENS, PIXELS, encoded, tone

from llamacrab import Image, Llama, MediaPolicy
from llamacrab.server import ServerSettings

from support import load_repo_module, wav_bytes

tiny = load_repo_module("scripts/make_tiny_gguf.py")
mmproj = load_repo_module("scripts/make_tiny_mmproj.py")
LIMIT = 20  # the server's --max-tokens-limit (above /v1/completions' default of 16)
CHAT = [{"role": "user", "content": "the cat"}]
GREEDY = {"temperature": 0}
# The tests' chat template, which opens the answer's turn only when asked
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
FIRST: dict[str, dict[str, Any]] = {  # what each route needs besides the fields tested
    "/v1/completions": {"prompt": "the cat"},
    "/v1/chat/completions": {"messages": CHAT},
    "/completion": {"prompt": "the cat"},
}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("requests") / "tiny.gguf"
    path: Path = tiny.write_tiny_llama(out, chat_templates={"": TEMPLATE})
    return path


@pytest.fixture(scope="module")
def server(tiny_path: Path) -> Iterator[LiveServer]:
    settings = ServerSettings(model=str(tiny_path), n_ctx=512, max_tokens_limit=LIMIT, max_n=4)
    yield from running(settings)


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


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_reads_llama_servers_token_limits(server: LiveServer, route: str) -> None:
    # ignore_eos: the answers run to their limit (it is read on every route too).
    count = lambda **body: generated(server, route, {"ignore_eos": True, **body})  # noqa: E731
    for name in ("max_tokens", "max_completion_tokens", "n_predict"):
        assert count(**{name: -1}) == LIMIT, name
        assert count(**{name: LIMIT + 1}) == LIMIT, name  # cut to the limit (it was a 400)
    # llama-server's order: n_predict, then max_completion_tokens, then max_tokens.
    assert count(max_tokens=3, max_completion_tokens=5) == 5
    assert count(max_tokens=5, max_completion_tokens=3) == 3
    assert count(max_tokens=5, max_completion_tokens=6, n_predict=2) == 2


# -- llama-server's fields on the OpenAI routes --------------------------------------------------


def test_json_schema_constrains_the_openai_routes(server: LiveServer) -> None:
    schema = {"json_schema": {"enum": ["yes", "no"]}, "max_tokens": LIMIT}
    text = post(server, "/v1/completions", {"prompt": "the cat", **schema})
    assert text["choices"][0]["text"] in ('"yes"', '"no"'), text
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, **schema})
    assert chat["choices"][0]["message"]["content"] in ('"yes"', '"no"'), chat
    # {} is any object, as llama-server reads it; a response_format schema of its own wins.
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "json_schema": {}})
    assert chat["choices"][0]["message"]["content"].startswith("{")
    own = {"type": "json_schema", "json_schema": {"schema": {"enum": ["maybe"]}}}
    chat = post(server, "/v1/chat/completions",
                {"messages": CHAT, **schema, "response_format": own})  # fmt: skip
    assert chat["choices"][0]["message"]["content"] == '"maybe"'
    # As llama-server's chat: a grammar beside it is refused; on completions the grammar wins.
    grammar = {"grammar": 'root ::= "x"'}
    assert refused(server, "/v1/chat/completions",
                   {"messages": CHAT, **schema, **grammar})["param"] == "json_schema"  # fmt: skip
    text = post(server, "/v1/completions", {"prompt": "the cat", **schema, **grammar})
    assert text["choices"][0]["text"] == "x"
    bad = refused(server, "/v1/completions", {"prompt": "the cat", "json_schema": {"type": 7}})
    assert bad["param"] == "json_schema"


def test_n_probs_and_ignore_eos_on_the_openai_routes(server: LiveServer, llama: Llama) -> None:
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "n_probs": 2, "max_tokens": 3})
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(e["top_logprobs"]) == 2 for e in content), chat
    text = post(server, "/v1/completions", {"prompt": "the cat", "n_probs": 2, "max_tokens": 3})
    logprobs = text["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 3 and all(len(t) == 2 for t in logprobs["top_logprobs"])
    # n_probs counts only where over 0 (as llama-server reads it): 0 leaves logprobs in charge.
    text = post(server, "/v1/completions",
                {"prompt": "the cat", "n_probs": 0, "logprobs": 3, "max_tokens": 2})  # fmt: skip
    assert [len(t) for t in text["choices"][0]["logprobs"]["top_logprobs"]] == [3, 3], text
    native = post(server, "/completion",
                  {"prompt": "the cat", "n_probs": 0, "logprobs": 3, "n_predict": 2})  # fmt: skip
    assert [len(p["top_logprobs"]) for p in native["completion_probabilities"]] == [3, 3]
    # As on /completion: the probabilities are before sampling, so post-sampling ones are refused.
    for route in ("/v1/chat/completions", "/v1/completions"):
        body = {**FIRST[route], "n_probs": 2, "post_sampling_probs": True}
        assert refused(server, route, body)["param"] == "post_sampling_probs"
    # A bias that makes the end of generation certain ends at once; ignore_eos bans it anyway.
    (end,) = llama.vocab.eog_tokens
    for route in ("/v1/completions", "/v1/chat/completions"):
        assert generated(server, route, {"logit_bias": {str(end): 100}, "max_tokens": 5}) == 0
        assert generated(server, route, {"logit_bias": {str(end): 100}, "max_tokens": 5,
                                         "ignore_eos": True}) == 5  # fmt: skip
    # A JSON answer ends where its text is complete, though ignore_eos bans the end token (it
    # was a 400 up front): only that end could follow.
    schema = {"enum": ["yes", "no"]}
    answer_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    for route, constraint in [("/v1/completions", "json_schema"), ("/completion", "json_schema"),
                              ("/v1/chat/completions", "json_schema"),
                              ("/v1/chat/completions", "response_format")]:  # fmt: skip
        given = answer_format if constraint == "response_format" else schema
        body = {**FIRST[route], constraint: given, "ignore_eos": True, "max_tokens": 20}
        answer = post(server, route, body)
        if route == "/completion":
            text, ended = answer["content"], answer["stop_type"] != "limit"
        else:
            (choice,) = answer["choices"]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            ended = choice["finish_reason"] == "stop"
        assert json.loads(text) in ("yes", "no") and ended, answer
        streamed = httpx.post(server.url + route, json={**GREEDY, **body, "stream": True})
        assert streamed.status_code == 200 and "error" not in streamed.text, streamed.text
    # A grammar of the client's own may never have to end: it runs to the limit.
    for route in ("/completion", "/v1/completions"):
        endless = {"grammar": "root ::= [a-z]+", "ignore_eos": True, "max_tokens": 3}
        assert generated(server, route, endless) == 3


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_logit_bias_in_llama_servers_forms(server: LiveServer, llama: Llama, route: str) -> None:
    def text(bias: object) -> str:
        answer = post(server, route, {**FIRST[route], "max_tokens": 1, "logit_bias": bias})
        choice = answer["choices"][0]
        return str(choice["message"]["content"] if "message" in choice else choice["text"])

    greedy = text(None)
    token = llama.tokenize(greedy, add_special=False)[-1]  # after the vocabulary's space mark
    # [[id, false]] bans, [[id, bias]], [[text, false]] (its tokens), {"text": bias}
    for bias in ([[token, False]], [[token, -100]], [[greedy, False]], {greedy: -100},
                 {str(token): False}, {f" +{token}": False}):  # fmt: skip
        assert text(bias) != greedy, bias
    # A key as strtol reads it: leading space and a sign, then digits (" 15" is id 15, not
    # text); a list's key is an id or a text, not true (read as id 1) nor 1.0.
    for key in (True, 1.0, None):
        error = refused(server, route, {**FIRST[route], "logit_bias": [[key, 5]]})
        assert error["param"].startswith("logit_bias"), key
    # A list's text is text even where it spells an id, as llama-server tokenizes it.
    assert text([[str(token), False]]) == greedy


# -- several prompts in one /v1/completions request ----------------------------------------------


def test_several_prompts_get_one_choice_each(server: LiveServer, llama: Llama) -> None:
    prompts = ["the cat", "a dog"]
    body = {"max_tokens": 3, "n": 2}
    one = [post(server, "/v1/completions", {"prompt": p, **body}) for p in prompts]
    ids = [llama.tokenize(p) for p in prompts]
    for batch in (prompts, ids, [prompts[0], ids[1]]):
        both = post(server, "/v1/completions", {"prompt": batch, **body})
        # OpenAI's order: each prompt's n choices together, indexed across the request.
        assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3], batch
        expected = [c["text"] for answer in one for c in answer["choices"]]
        assert [c["text"] for c in both["choices"]] == expected, batch
        for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert both["usage"][field] == sum(a["usage"][field] for a in one), field
    refusals = {
        "more than --max-n": {"prompt": prompts * 3},
        "an empty one": {"prompt": ["the cat", []]},
        "an empty text": {"prompt": ["the cat", ""]},
        "ids with suffix": {"prompt": ["the cat", [1, 2]], "suffix": "end"},
    }
    for why, extra in refusals.items():
        assert refused(server, "/v1/completions", extra)["param"] in ("prompt", "suffix"), why
    # /completion's prompt list: the same limit; streamed, one prompt (/v1/completions streams
    # them, tests/test_server_stream_choices.py).
    native = refused(server, "/completion", refusals["more than --max-n"])
    assert native == refused(server, "/v1/completions", refusals["more than --max-n"])
    assert refused(server, "/completion", {"prompt": prompts, "stream": True})["param"] == "prompt"


# -- /completion's prompt object -----------------------------------------------------------------


def test_a_prompt_object_is_its_prompt_string(server: LiveServer, llama: Llama) -> None:
    body = {"n_predict": 3, "return_tokens": True}
    plain = post(server, "/completion", {"prompt": "the cat", **body})
    mixed = [llama.vocab.bos, "the cat"]  # BOS as an id, then the text
    assert post(server, "/completion", {"prompt": mixed, **body})["tokens"] == plain["tokens"]
    for prompt in ({"prompt_string": "the cat"}, {"prompt_string": mixed}):
        answer = post(server, "/completion", {"prompt": prompt, **body})
        assert answer["tokens"] == plain["tokens"], prompt
    for empty in ({"prompt_string": []}, [{"prompt_string": []}, "a dog"], []):
        assert refused(server, "/completion", {"prompt": empty})["param"] == "prompt", empty
    several = post(server, "/completion",
                   {"prompt": [{"prompt_string": "the cat"}, "a dog"], **body})  # fmt: skip
    assert [a["index"] for a in several] == [0, 1] and several[0]["tokens"] == plain["tokens"]
    # Without a projector, images are refused as on every route.
    png = base64.b64encode(encoded(PIXELS, "PNG")).decode()
    media = {"prompt_string": "see <__media__>", "multimodal_data": [png]}
    error = refused(server, "/completion", {"prompt": media})
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}}
    chat = refused(server, "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": [image]}]})  # fmt: skip
    assert error["message"] == chat["message"] and "projector" in error["message"]


@pytest.fixture(scope="module")
def vision_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = mmproj.write_tiny_vision_mmproj(tmp_path_factory.mktemp("seeing") / "v.gguf")
    return path


@pytest.fixture(scope="module")
def seeing(tiny_path: Path, vision_path: Path) -> Iterator[LiveServer]:
    settings = ServerSettings(model=str(tiny_path), mmproj=str(vision_path), n_ctx=1024,
                              max_media=2)  # fmt: skip
    yield from running(settings)


def test_a_prompt_objects_images_with_a_projector(
    seeing: LiveServer, tiny_path: Path, vision_path: Path
) -> None:
    png = encoded(PIXELS, "PNG")
    body = {"n_predict": 3, "return_tokens": True}
    prompt = {"prompt_string": "see <__media__> now",
              "multimodal_data": [base64.b64encode(png).decode()]}  # fmt: skip
    answer = post(seeing, "/completion", {"prompt": prompt, **body})
    assert answer["tokens_evaluated"] > IMAGE_TOKENS
    with Llama(tiny_path, n_ctx=1024, n_threads=2, mmproj=vision_path) as llama:
        chunks = llama.tokenize_media("see <__media__> now", [Image(data=png)], True, True)
        expected = llama.create_completion(chunks, max_tokens=3, temperature=0)
    assert answer["tokens"] == list(expected.choices[0].tokens)
    wav = base64.b64encode(wav_bytes(tone(16000), 16000)).decode()
    for media, words in (
        ([prompt["multimodal_data"][0]] * 2, "media markers"),  # two images, one marker
        (["!!"], "base64"),
        ([wav], "no audio encoder"),  # a sound, known by its signature
    ):
        error = refused(seeing, "/completion", {"prompt": {**prompt, "multimodal_data": media}})
        assert words in error["message"], (words, error)
    ids = {"prompt_string": [1, "see <__media__>"], "multimodal_data": prompt["multimodal_data"]}
    assert "prompt_string is text" in refused(seeing, "/completion", {"prompt": ids})["message"]


def test_a_prompt_objects_media_obey_the_size_cap_a_chats_do(
    tiny_path: Path, vision_path: Path
) -> None:
    png = encoded(PIXELS, "PNG")
    data = base64.b64encode(png).decode()
    prompt = {"prompt_string": "see <__media__> now", "multimodal_data": [data]}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}
    chat = {"messages": [{"role": "user", "content": [image]}], "max_tokens": 1}
    policy = MediaPolicy(local_files=False, max_bytes=len(png) - 1)
    settings = ServerSettings(model=str(tiny_path), mmproj=str(vision_path), n_ctx=1024)
    llama = Llama(tiny_path, n_ctx=1024, mmproj=vision_path, media_policy=policy)
    server = LiveServer(settings, llama)
    try:
        assert server.wait_until_loaded() == 200
        # The chat's image was refused and the prompt object's decoded and encoded.
        for route, body in (("/v1/chat/completions", chat), ("/completion", {"prompt": prompt})):
            assert f"exceeds {len(png) - 1} bytes" in refused(server, route, body)["message"]
    finally:
        server.close()
        llama.close()


def test_embeddings_take_a_prompt_object_without_media(tiny_path: Path) -> None:
    for server in running(ServerSettings(model=str(tiny_path), n_ctx=256, embeddings=True)):
        for route in ("/embedding", "/embeddings"):
            plain = post(server, route, {"content": "the cat"})
            same = post(server, route, {"content": {"prompt_string": "the cat"}})
            assert same == plain, route
            media = {"prompt_string": "the cat <__media__>", "multimodal_data": ["AAAA"]}
            assert refused(server, route, {"content": media})["param"] == "content"


# -- /apply-template -----------------------------------------------------------------------------


def test_apply_template_can_leave_out_the_generation_prompt(
    server: LiveServer, llama: Llama
) -> None:
    def applied(messages: list[dict[str, str]], **extra: Any) -> str:
        return str(post(server, "/apply-template", {"messages": messages, **extra})["prompt"])

    assert applied(CHAT) == "<user>the cat<assistant>" == llama.chat_prompt(CHAT)
    closed = applied(CHAT, add_generation_prompt=False)
    assert closed == "<user>the cat" == llama.chat_prompt(CHAT, add_generation_prompt=False)
    # A last assistant message is continued in the answer's turn all the same (llama-server).
    prefill = [*CHAT, {"role": "assistant", "content": "It"}]
    assert applied(prefill, add_generation_prompt=False) == "<user>the cat<assistant>It"
