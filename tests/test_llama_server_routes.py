"""llama-server's own routes, live on loopback, with llama-server's field names: /infill,
/apply-template, /tokenize and /detokenize, /props, /slots (save/restore of a slot's state) and
/v1/audio/transcriptions."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from live_server import LiveServer
from test_multimodal import tone
from test_tool_calls import TEMPLATE

from llamacrab import InfillLimits, Llama
from llamacrab._native.vocab import Vocab
from llamacrab.server import ServerSettings

from support import load_repo_module, wav_bytes

tiny = load_repo_module("scripts/make_tiny_gguf.py")
mmproj = load_repo_module("scripts/make_tiny_mmproj.py")
KEY = {"Authorization": "Bearer sesame"}
INFILL: dict[str, Any] = {
    "input_prefix": "def area(r):\n    ",
    "input_suffix": "\n    return a\n",
    "input_extra": [{"filename": "constants.py", "text": "PI = 3.14159\n"}],
    "n_predict": 6,
    "temperature": 0,
}


def _running(settings: ServerSettings, llama: Llama | None = None) -> Iterator[LiveServer]:
    server = LiveServer(settings, llama)
    try:
        assert server.wait_until_loaded() == 200
        yield server
    finally:
        server.close()


def events(text: str) -> list[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream."""
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.fixture(scope="module")
def fim_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tiny.write_tiny_llama(tmp_path_factory.mktemp("fim") / "fim.gguf", fim=True)
    return path


@pytest.fixture(scope="module")
def fim_server(fim_path: Path) -> Iterator[LiveServer]:
    """A tiny model with FIM tokens behind an API key; no --slot-save-path, no --props."""
    settings = ServerSettings(model=str(fim_path), model_alias="fim", n_ctx=256,
                              api_keys=("sesame",), max_body_bytes=4096)  # fmt: skip
    yield from _running(settings)


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def gemma_server(gemma_path: Path, slot_dir: Path) -> Iterator[LiveServer]:
    """Gemma as `llamacrab serve` runs it: parallel slots."""
    settings = ServerSettings(model=str(gemma_path), model_alias="gemma", parallel=2,
                              n_ctx=2 * 512, n_threads=2,
                              slot_save_path=str(slot_dir))  # fmt: skip
    yield from _running(settings)


@pytest.fixture(scope="module")
def one_slot_server(gemma_path: Path, slot_dir: Path) -> Iterator[LiveServer]:
    """Gemma on a Llama without parallel slots (its state can be saved), with --props."""
    settings = ServerSettings(model=str(gemma_path), model_alias="gemma", n_ctx=1024,
                              slot_save_path=str(slot_dir), props=True)  # fmt: skip
    with Llama(gemma_path, n_ctx=1024, n_threads=2) as llama:
        yield from _running(settings, llama)


# -- /infill -------------------------------------------------------------------------------------


def test_infill_matches_the_python_api(fim_server: LiveServer, fim_path: Path) -> None:
    answer = httpx.post(fim_server.url + "/infill", json={**INFILL, "return_tokens": True},
                        headers=KEY)  # fmt: skip
    assert answer.status_code == 200, answer.text
    body = answer.json()
    with Llama(fim_path, n_ctx=256, n_threads=2) as llama:
        expected = llama.create_infill(
            INFILL["input_prefix"], INFILL["input_suffix"], repo="myproject",
            files=[("constants.py", "PI = 3.14159\n")], file_name="filename", max_tokens=6,
            temperature=0,
        )  # fmt: skip
    assert body["content"] == expected.text
    assert body["tokens"] == list(expected.choices[0].tokens)
    assert body["tokens_evaluated"] == expected.usage.prompt_tokens
    assert body["tokens_predicted"] == 6 and body["stop"] is True
    assert body["stop_type"] == "limit" and body["model"] == "fim"
    timings = body["timings"]
    assert (
        timings["predicted_n"] == 6
        and timings["prompt_n"] + timings["cache_n"] == (body["tokens_evaluated"])
    )
    # llama-server's arithmetic (benchmarks and llama.vim read these): the first token comes
    # with the prompt, the rates count the 5 steps after it.
    for name, rated in (("prompt", timings["prompt_n"]), ("predicted", 5)):
        ms = timings[f"{name}_ms"]
        assert ms > 0 and timings[f"{name}_per_token_ms"] == pytest.approx(ms / rated)
        assert timings[f"{name}_per_second"] == pytest.approx(rated / ms * 1000)


def test_openai_suffix_fills_in_the_middle(
    fim_server: LiveServer, fim_path: Path, gemma_server: LiveServer
) -> None:
    """/v1/completions' ``suffix`` is OpenAI's insertion: the answer goes between the prompt
    and the suffix (it was glued after the answer, which the model never saw it before)."""
    prefix, suffix = INFILL["input_prefix"], INFILL["input_suffix"]
    body = {"prompt": prefix, "suffix": suffix, "max_tokens": 6, "temperature": 0}
    answer = httpx.post(fim_server.url + "/v1/completions", json=body, headers=KEY)
    assert answer.status_code == 200, answer.text
    with Llama(fim_path, n_ctx=256, n_threads=2) as llama:
        expected = llama.create_infill(prefix, suffix, max_tokens=6, temperature=0)
    assert answer.json()["choices"][0]["text"] == expected.text
    assert answer.json()["usage"]["prompt_tokens"] == expected.usage.prompt_tokens
    streamed = httpx.post(fim_server.url + "/v1/completions", headers=KEY,
                          json={**body, "stream": True}).text  # fmt: skip
    assert "".join(e["choices"][0]["text"] for e in events(streamed)) == expected.text
    for path, extra, words in (
        (gemma_server.url, {}, "no fill-in-the-middle tokens"),
        (fim_server.url, {"echo": True}, "echo cannot be used with suffix"),
        (fim_server.url, {"prompt": [1, 2]}, "suffix needs a text prompt"),
    ):
        refused = httpx.post(path + "/v1/completions", headers=KEY, json={**body, **extra})
        assert refused.status_code == 400 and words in refused.json()["error"]["message"]


def test_infill_cuts_a_prompt_too_long_as_llama_server(
    fim_server: LiveServer, fim_path: Path
) -> None:
    # An editor sends a long prefix and its ring of context chunks: llama-server cuts them to
    # fit (the prefix's end, the suffix's start, the context's end); llamacrab refused (400).
    body = {**INFILL, "input_prefix": "the cat sat. " * 250, "input_suffix": "the end " * 40}
    answer = httpx.post(fim_server.url + "/infill", json=body, headers=KEY)
    assert answer.status_code == 200, answer.text
    files = [("constants.py", INFILL["input_extra"][0]["text"])]
    with Llama(fim_path, n_ctx=256, n_threads=2) as llama:
        whole = llama.infill_prompt(body["input_prefix"], body["input_suffix"], repo="myproject",
                                    files=files, file_name="filename")  # fmt: skip
        # llama-server's budgets with a batch of half the context: prefix 96, suffix 30,
        # and the repository context what is left of the 255 positions (all of it here).
        cut = llama.infill_prompt(body["input_prefix"], body["input_suffix"], repo="myproject",
                                  files=files, file_name="filename",
                                  limits=InfillLimits.llama_server(128, 256))  # fmt: skip
    assert len(whole) > 256 > len(cut)
    assert answer.json()["tokens_evaluated"] == len(cut)
    # A long repository context gives up what still does not fit: one position stays free.
    chunks = [{"filename": "big.py", "text": "x = 1\n" * 300}]
    crowded = {**body, "input_prefix": "the cat sat. " * 60, "input_extra": chunks}
    answer = httpx.post(fim_server.url + "/infill", json=crowded, headers=KEY)
    assert answer.status_code == 200 and answer.json()["tokens_evaluated"] == 255, answer.text
    # One that fits is sent whole (llama-server would cut it too: more context here).
    fits = httpx.post(fim_server.url + "/infill", json=INFILL, headers=KEY).json()
    with Llama(fim_path, n_ctx=256, n_threads=2) as llama:
        expected = llama.infill_prompt(INFILL["input_prefix"], INFILL["input_suffix"],
                                       repo="myproject", files=files,
                                       file_name="filename")  # fmt: skip
    assert fits["tokens_evaluated"] == len(expected)


def test_infill_streams_llama_server_events(fim_server: LiveServer) -> None:
    whole = httpx.post(fim_server.url + "/infill", json=INFILL, headers=KEY).json()
    answer = httpx.post(fim_server.url + "/infill", json={**INFILL, "stream": True}, headers=KEY)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in answer.text  # llama-server's /completion stream has none
    stream = events(answer.text)
    assert [e["stop"] for e in stream] == [False] * (len(stream) - 1) + [True]
    assert "".join(str(e["content"]) for e in stream) == whole["content"]
    assert sum(len(e["tokens"]) for e in stream) == 6
    assert stream[-1]["tokens_predicted"] == 6
    # As llama-server: the last event has the counts and no text (clients read the text from
    # the events before it).
    assert stream[-1]["content"] == "" and stream[-1]["tokens"] == []
    # The same prompt again: its tokens but the last come from the slot's memory; after it,
    # the slot holds it and the answer but the last token (never decoded).
    assert stream[-1]["timings"]["cache_n"] == whole["tokens_evaluated"] - 1
    assert stream[-1]["tokens_cached"] == whole["tokens_evaluated"] + 6 - 1


# -- /completion ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/completion", "/completions"])
def test_completion_matches_the_python_api(
    fim_server: LiveServer, fim_path: Path, path: str
) -> None:
    with Llama(fim_path, n_ctx=256, n_threads=2) as llama:
        expected = llama.create_completion("the cat", max_tokens=5, temperature=0)
        prompt = llama.tokenize("the cat")
        rest = llama.tokenize("the cat", add_special=False)
        bias_token = expected.choices[0].tokens[0]
    body = {"prompt": "the cat", "n_predict": 5, "temperature": 0, "return_tokens": True}
    answer = httpx.post(fim_server.url + path, json=body, headers=KEY)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["content"] == expected.choices[0].text and got["stop"] is True
    assert got["tokens"] == list(expected.choices[0].tokens)
    assert got["tokens_evaluated"] == len(prompt) and got["tokens_predicted"] == 5
    assert got["stop_type"] == "limit" and got["model"] == "fim"
    # The same prompt as token ids, and as ids and text mixed (BOS as an id, then the text).
    assert prompt[1:] == rest  # the tiny model adds BOS
    for same in (prompt, [prompt[0], "the cat"]):
        again = httpx.post(fim_server.url + path, headers=KEY, json={**body, "prompt": same})
        assert again.json()["tokens"] == got["tokens"], again.text
    # llama-server's forms of logit_bias: [[id, false]] bans, {"id": bias}.
    for bias in ([[bias_token, False]], {str(bias_token): -1e9}):
        banned = httpx.post(fim_server.url + path, headers=KEY,
                            json={**body, "logit_bias": bias}).json()  # fmt: skip
        assert bias_token not in banned["tokens"], banned


@pytest.mark.real_model
def test_completion_says_its_slot_settings_prompt_and_what_the_slot_holds(
    one_slot_server: LiveServer,
) -> None:
    """As llama-server's answer (and its stream's last event) does: ``id_slot`` the slot that
    ran it (it was -1), ``tokens_cached`` the tokens that slot holds after it (it was the
    count reused, which ``timings.cache_n`` keeps), the sampling it ran with and its prompt's
    text (both were missing)."""
    url = one_slot_server.url
    defaults = httpx.get(url + "/props").json()["default_generation_settings"]["params"]
    body = {"prompt": "The capital of France is", "n_predict": 4, "temperature": 0,
            "top_k": 7, "stop": ["zzz"], "repeat_last_n": 16, "samplers": ["top_k", "temp"],
            "logit_bias": [[506, False], [999, 2]]}  # fmt: skip
    cases = [(body, "limit"), ({**body, "grammar": 'root ::= " Paris"'}, "eos")]
    for asked, stop_type in cases:
        for streamed in (False, True):
            answer = httpx.post(url + "/completion", json={**asked, "stream": streamed})
            last = events(answer.text)[-1] if streamed else answer.json()
            assert last["stop_type"] == stop_type, last
            held = httpx.get(url + "/slots").json()[0]["n_prompt_tokens"]
            assert last["tokens_cached"] == held, (last, held)
            assert last["id_slot"] == 0 and last["prompt"] == "<bos>The capital of France is"
            used = last["generation_settings"]
            assert set(defaults) <= set(used), set(defaults) - set(used)
            assert (used["n_predict"], used["temperature"], used["top_k"]) == (4, 0, 7)
            assert (used["stop"], used["repeat_last_n"], used["stream"]) == (["zzz"], 16, streamed)
            assert used["samplers"] == ["top_k", "temperature"]
            assert used["logit_bias"] == [{"bias": None, "token": 506}, {"bias": 2, "token": 999}]
            assert used["grammar"] == asked.get("grammar", "")
            if streamed:
                assert all(e["id_slot"] == 0 for e in events(answer.text)), answer.text
    limited = httpx.post(url + "/completion", json=body).json()
    assert limited["tokens_cached"] == limited["tokens_evaluated"] + 4 - 1  # as llama-server's
    assert limited["timings"]["cache_n"] > 0  # the prompt, reused from the requests before


@pytest.mark.real_model
def test_each_answer_names_the_slot_that_ran_it(gemma_server: LiveServer) -> None:
    """Two requests at once run on the two slots: each answer names its own (both said -1)."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(prompt: str) -> int:
        body = {"prompt": prompt, "n_predict": 24, "temperature": 0}
        return int(httpx.post(gemma_server.url + "/completion", json=body).json()["id_slot"])

    with ThreadPoolExecutor(2) as pool:
        slots = list(pool.map(ask, ["The capital of France is", "Once upon a time"]))
    assert sorted(slots) == [0, 1]


def test_a_logit_bias_key_of_other_digits_is_text_as_in_llama_server(
    fim_server: LiveServer,
) -> None:
    # Found by fuzzing: "²" passed str.isdigit and int() refused it, a 500 with a traceback;
    # "٣" was read as token 3. llama-server reads a key with strtol: such text is text.
    body = {"prompt": "the cat", "n_predict": 2, "temperature": 0}
    for key in ("²", "-²", "٣"):
        for bias in ({key: 1}, [[key, False]]):
            answer = httpx.post(fim_server.url + "/completion", headers=KEY,
                                json={**body, "logit_bias": bias})  # fmt: skip
            assert answer.status_code == 200, (key, answer.text)


def test_completion_answers_several_prompts_in_order(fim_server: LiveServer) -> None:
    url, body = fim_server.url, {"n_predict": 4, "temperature": 0, "return_tokens": True}

    def one(prompt: object) -> Any:
        answer = httpx.post(url + "/completion", headers=KEY, json={**body, "prompt": prompt})
        assert answer.status_code == 200, answer.text
        return answer.json()

    cat, dog = one("the cat"), one("a dog")
    single = one(["the cat"])  # one prompt: one object
    assert isinstance(single, dict) and single["tokens"] == cat["tokens"]
    ids = httpx.post(url + "/tokenize", headers=KEY,
                     json={"content": "a dog", "add_special": True}).json()["tokens"]  # fmt: skip
    for several in (["the cat", "a dog"], ["the cat", ids], [["the cat"], [ids[0], "a dog"]]):
        both = one(several)
        assert [a["index"] for a in both] == [0, 1], several
        assert [a["tokens"] for a in both] == [cat["tokens"], dog["tokens"]], several
    # A token id among the strings makes them one prompt, as llama-server reads it.
    assert isinstance(one([ids[0], "a dog"]), dict)
    refused = {
        "streamed": {"prompt": ["a", "b"], "stream": True},
        "too many": {"prompt": ["a"] * 9},
        "an empty one": {"prompt": ["a", []]},
    }
    for why, extra in refused.items():
        answer = httpx.post(url + "/completion", headers=KEY, json={**body, **extra})
        assert answer.status_code == 400, why
        assert answer.json()["error"]["param"] == "prompt", why


def test_completion_answers_only_the_response_fields_asked_for(fim_server: LiveServer) -> None:
    # They were dropped: the whole answer came back.
    url, body = fim_server.url, {"prompt": "the cat", "n_predict": 4, "temperature": 0}
    fields = ["content", "generation_settings/n_predict", "timings/predicted_n", "nothing/here"]
    whole = httpx.post(url + "/completion", headers=KEY, json=body).json()
    cut = httpx.post(url + "/completion", headers=KEY, json={**body, "response_fields": fields})
    assert cut.status_code == 200, cut.text
    assert cut.json() == {"content": whole["content"], "generation_settings/n_predict": 4,
                          "timings/predicted_n": whole["timings"]["predicted_n"]}  # fmt: skip
    several = httpx.post(
        url + "/completion",
        headers=KEY,
        json={**body, "prompt": ["the cat", "a dog"], "response_fields": ["index"]},
    )
    assert several.json() == [{"index": 0}, {"index": 1}]
    streamed = httpx.post(
        url + "/completion",
        headers=KEY,
        json={**body, "stream": True, "response_fields": ["stop", "stop_type"]},
    )
    *pieces, last = events(streamed.text)
    assert "".join(p["content"] for p in pieces) == whole["content"]  # the pieces as they were
    assert last == {"stop": True, "stop_type": whole["stop_type"]}
    infill = httpx.post(url + "/infill", headers=KEY, json={**INFILL, "response_fields": ["model"]})
    assert infill.json() == {"model": "fim"}


def test_min_keep_is_refused_naming_it(fim_server: LiveServer) -> None:
    # It was dropped: the samplers ran as if it were 0.
    url = fim_server.url
    for path, body in (
        ("/completion", {"prompt": "the cat"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        answer = httpx.post(url + path, headers=KEY, json={**body, "n_predict": 2, "min_keep": 5})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "min_keep"
    kept = httpx.post(url + "/completion", headers=KEY,
                      json={"prompt": "the cat", "n_predict": 2, "min_keep": 0})  # fmt: skip
    assert kept.status_code == 200


def test_completion_takes_a_json_schema_and_lora(fim_server: LiveServer) -> None:
    url, body = fim_server.url, {"prompt": "the cat", "n_predict": 24, "temperature": 0}

    def content(**extra: Any) -> str:
        answer = httpx.post(url + "/completion", headers=KEY, json={**body, **extra})
        assert answer.status_code == 200, answer.text
        return str(answer.json()["content"])

    assert content(json_schema={"enum": ["yes", "no"]}) in ('"yes"', '"no"')
    assert content(json_schema={}).startswith("{")  # any object, as llama-server reads {}
    # A grammar given as well wins (llama-server uses the schema only without one).
    assert content(json_schema={"enum": ["yes"]}, grammar='root ::= "x"') == "x"
    for path, extra in (("/completion", body), ("/infill", INFILL)):
        bad = httpx.post(url + path, headers=KEY, json={**extra, "json_schema": {"type": 7}})
        assert bad.status_code == 400 and "json_schema" in bad.json()["error"]["message"]
        # The request's LoRA scales are read (this server has no adapter to name).
        lora = httpx.post(url + path, headers=KEY, json={**extra, "lora": [{"id": 0, "scale": 1}]})
        assert lora.status_code == 400 and "no LoRA adapter with id 0" in lora.text


def test_completion_probabilities_as_llama_server(fim_server: LiveServer, fim_path: Path) -> None:
    body = {"prompt": "the cat", "n_predict": 4, "temperature": 0, "return_tokens": True}
    with Llama(fim_path, n_ctx=256, n_threads=2) as llama:
        expected = llama.create_completion("the cat", max_tokens=4, temperature=0, logprobs=3)
        logprobs = expected.choices[0].logprobs
        assert logprobs is not None
        for top, ids in zip(logprobs.top_logprobs, logprobs.top_ids, strict=True):
            assert list(top) == [llama.vocab.token_to_piece(i, special=True) for i in ids]
        raw = {
            t: llama.vocab.token_to_bytes(t, special=True) for ids in logprobs.top_ids for t in ids
        }
    url = fim_server.url + "/completion"
    # Once first, so that every request compared below decodes after the same cached prompt
    # (alone, the first decoded it fresh: values equal only up to float noise).
    httpx.post(url, headers=KEY, json=body).raise_for_status()
    got = httpx.post(url, headers=KEY, json={**body, "n_probs": 3}).json()
    probs = got["completion_probabilities"]
    assert [p["id"] for p in probs] == got["tokens"] == list(expected.choices[0].tokens)
    for p, logprob, ids in zip(probs, logprobs.token_logprobs, logprobs.top_ids, strict=True):
        assert p["logprob"] == pytest.approx(logprob, abs=1e-4)
        assert [t["id"] for t in p["top_logprobs"]] == list(ids)
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the likeliest
        assert all(bytes(t["bytes"]) == raw[t["id"]] for t in p["top_logprobs"])
        values = [t["logprob"] for t in p["top_logprobs"]]
        assert values == sorted(values, reverse=True)
    # "logprobs" is its other name; streamed, each event carries its own tokens' entries.
    alias = httpx.post(url, headers=KEY, json={**body, "logprobs": 3}).json()
    assert alias["completion_probabilities"] == probs
    streamed = httpx.post(url, headers=KEY, json={**body, "n_probs": 3, "stream": True}).text
    pieces = [e.get("completion_probabilities", []) for e in events(streamed)]
    flat = [p for piece in pieces for p in piece]
    # The same tokens; the values up to float noise (the prompt comes from the slot's memory)
    assert [(p["id"], [t["id"] for t in p["top_logprobs"]]) for p in flat] == [
        (p["id"], [t["id"] for t in p["top_logprobs"]]) for p in probs
    ]
    assert [p["logprob"] for p in flat] == pytest.approx([p["logprob"] for p in probs], abs=1e-4)
    assert "completion_probabilities" not in httpx.post(url, headers=KEY, json=body).json()
    for bad in ({"n_probs": 3, "post_sampling_probs": True}, {"n_probs": 21}):
        refused = httpx.post(url, headers=KEY, json={**body, **bad})
        assert refused.status_code == 400, bad


def test_samplers_choose_the_chain_as_in_llama_server(
    fim_server: LiveServer, fim_path: Path
) -> None:
    settings = {"top_p": 0.5, "min_p": 0.0, "temperature": 1.5, "seed": 5}

    def tokens(llama: Llama, **chain: Any) -> list[int]:
        answer = llama.create_completion("the cat", max_tokens=8, **chain, **settings)
        return list(answer.choices[0].tokens)

    with Llama(fim_path, n_ctx=256, n_threads=2) as llama:
        default = tokens(llama)
        expected = tokens(llama, order=("temperature", "top_p"))
        other_way = tokens(llama, order=("top_p", "temperature"))
        # llama.vim's and llama.vscode's FIM chain: top-k, top-p, then the infill sampler.
        fim = tokens(llama, order=("top_k", "top_p"), infill=True)
    assert len({tuple(default), tuple(expected), tuple(other_way)}) == 3  # the order tells
    body = {"prompt": "the cat", "max_tokens": 8, "return_tokens": True, **settings}

    def served(path: str, samplers: object) -> Any:
        answer = httpx.post(fim_server.url + path, headers=KEY,
                            json={**body, "samplers": samplers})  # fmt: skip
        assert answer.status_code == 200, answer.text
        return answer.json()

    for samplers in (["temperature", "top_p"], ["TEMP", "nucleus"], "tp"):
        assert served("/completion", samplers)["tokens"] == expected, samplers
    assert served("/completion", ["top_k", "top_p", "infill"])["tokens"] == fim
    with Llama(fim_path, n_ctx=256, n_threads=2) as llama:
        text = llama.detokenize(expected)
    assert served("/v1/completions", "tp")["choices"][0]["text"] == text  # every route
    for samplers in (["top_k", "beam"], "kpz"):
        bad = httpx.post(fim_server.url + "/completion", headers=KEY,
                         json={**body, "samplers": samplers})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "samplers"


def test_a_completion_that_fills_the_context_is_truncated(fim_server: LiveServer) -> None:
    body = {"prompt": "the cat", "temperature": 0, "ignore_eos": True}
    for extra in ({}, {"stream": True}):
        answer = httpx.post(fim_server.url + "/completion", headers=KEY, json={**body, **extra})
        last = events(answer.text)[-1] if extra else answer.json()
        assert last["truncated"] is True and last["stop_type"] == "limit", last
        assert last["tokens_evaluated"] + last["tokens_predicted"] >= 255  # n_ctx 256
    short = httpx.post(fim_server.url + "/completion", headers=KEY, json={**body, "n_predict": 3})
    assert short.json()["truncated"] is False and short.json()["stop_type"] == "limit"


def test_ignore_eos_with_a_json_answer_ends_where_the_json_is_complete(
    fim_server: LiveServer,
) -> None:
    # Was a 400 up front: once the JSON is complete only an end token may follow, which
    # ignore_eos bans. The library now ends there, with "stop", as llama-server clients expect.
    body = {"prompt": "the cat", "temperature": 0, "max_tokens": 40, "ignore_eos": True,
            "json_schema": {"enum": ["yes", "no"]}}  # fmt: skip
    answer = httpx.post(fim_server.url + "/v1/completions", headers=KEY, json=body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert json.loads(choice["text"]) in ("yes", "no") and choice["finish_reason"] == "stop"
    native = httpx.post(fim_server.url + "/completion", headers=KEY, json=body)
    assert native.status_code == 200, native.text
    assert json.loads(native.json()["content"]) in ("yes", "no")
    assert native.json()["stop_type"] != "limit"


def test_completion_streams_and_takes_llama_servers_samplers(fim_server: LiveServer) -> None:
    body = {"prompt": "the cat", "n_predict": 6, "temperature": 0, "ignore_eos": True,
            "dry_multiplier": 0.8, "repeat_last_n": 16, "xtc_probability": 0.0,
            "top_n_sigma": -1, "cache_prompt": True}  # fmt: skip
    whole = httpx.post(fim_server.url + "/completion", json=body, headers=KEY)
    assert whole.status_code == 200, whole.text
    assert whole.json()["tokens_predicted"] == 6  # ignore_eos: never ends early
    answer = httpx.post(fim_server.url + "/completion", json={**body, "stream": True},
                        headers=KEY)  # fmt: skip
    assert "[DONE]" not in answer.text
    stream = events(answer.text)
    assert [e["stop"] for e in stream] == [False] * (len(stream) - 1) + [True]
    assert "".join(str(e["content"]) for e in stream) == whole.json()["content"]
    # The OpenAI route takes the same samplers; out of range is a 400 naming the field.
    chat = {"prompt": "the cat", "max_tokens": 2, "dry_multiplier": 0.8, "dry_penalty_last_n": -2}
    refused = httpx.post(fim_server.url + "/v1/completions", json=chat, headers=KEY)
    assert refused.status_code == 400 and "dry" in refused.json()["error"]["message"]
    outside = httpx.post(fim_server.url + "/completion", headers=KEY,
                         json={"prompt": [1, 10**6], "n_predict": 1})  # fmt: skip
    assert outside.status_code == 400 and "outside the vocabulary" in outside.text


def test_llama_servers_other_route_names(fim_server: LiveServer) -> None:
    url = fim_server.url
    assert httpx.get(url + "/v1/health").json() == {"status": "ok"}  # no key: public
    assert httpx.get(url + "/models", headers=KEY).json()["data"][0]["id"] == "fim"
    chat = httpx.post(url + "/chat/completions", headers=KEY, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})  # fmt: skip
    assert chat.status_code in (200, 400), chat.text  # the FIM model has no chat template


@pytest.mark.real_model
def test_infill_refuses_what_it_cannot_do(fim_server: LiveServer, gemma_server: LiveServer) -> None:
    no_fim = httpx.post(gemma_server.url + "/infill", json=INFILL)
    assert no_fim.status_code == 400
    assert "fill-in-the-middle" in no_fim.json()["error"]["message"]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"n": 2}, "n must be 1"),
        ({"input_prefix": None}, "input_prefix"), ({"seed": -2}, "seed"),
    ]  # fmt: skip
    for extra, words in cases:
        answer = httpx.post(fim_server.url + "/infill", json={**INFILL, **extra}, headers=KEY)
        assert answer.status_code == 400 and words in answer.text, answer.text


def test_limits_and_keys_hold_on_these_routes(fim_server: LiveServer) -> None:
    url = fim_server.url
    assert httpx.post(url + "/tokenize", json={"content": "a"}).status_code == 401
    assert httpx.get(url + "/props").status_code == 401
    assert httpx.get(url + "/slots").status_code == 401
    huge = {**INFILL, "input_prefix": "x" * 5000}
    assert httpx.post(url + "/infill", json=huge, headers=KEY).status_code == 413
    assert httpx.post(url + "/infill", json=INFILL, headers=KEY).status_code == 200
    metrics = httpx.get(url + "/metrics", headers=KEY).text
    assert 'route="/infill",status="200"' in metrics
    assert "llamacrab_prompt_tokens_total 0\n" not in metrics  # /infill counted its tokens
    for path, body in (("/infill", INFILL), ("/completion", {"prompt": "a"})):
        # Past --max-tokens-limit: cut to it (a 400 before), as llama-server stops at its context.
        over = httpx.post(url + path, json={**body, "n_predict": 10**6}, headers=KEY).json()
        assert over["generation_settings"]["n_predict"] == 4096, over


# -- /embedding, /embeddings ---------------------------------------------------------------------


def test_llama_servers_embedding_routes() -> None:
    path = load_repo_module("scripts/convert_bert.py").minilm()
    texts = ["A cat sits on the mat.", "Stock markets fell today."]
    with Llama(path, embeddings=True, n_threads=2) as reference:
        raw = np.asarray(reference.embed(texts, normalize=False), dtype=np.float64)
        ids = reference.tokenize(texts[0])
    with Llama(path, embeddings=True, pooling="none", n_threads=2) as reference:
        per_token = reference.embed_tokens(texts)
    norms = {  # embd_normalize -> each row's divisor, as llama.cpp's common_embd_normalize
        -1: np.ones(2), 0: np.abs(raw).max(axis=1) / 32760, 1: np.abs(raw).sum(axis=1),
        2: np.linalg.norm(raw, axis=1), 3: (np.abs(raw) ** 3).sum(axis=1) ** (1 / 3),
    }  # fmt: skip
    for server in _running(ServerSettings(model=str(path), embeddings=True, n_threads=2)):
        for norm, divisor in norms.items():
            for path_name in ("/embedding", "/embeddings"):
                asked = {"content": texts, "embd_normalize": norm}
                got = httpx.post(server.url + path_name, json=asked).json()
                assert [g["index"] for g in got] == [0, 1]
                vectors = np.array([g["embedding"][0] for g in got])
                assert np.allclose(vectors, raw / divisor[:, None], rtol=1e-4, atol=1e-5), norm
        default = httpx.post(server.url + "/embedding", json={"input": texts[0]}).json()
        assert np.allclose(default[0]["embedding"][0], raw[0] / norms[2][0], atol=1e-5)
        # Token ids (with the BOS/CLS and SEP the vocabulary adds) are one input.
        as_ids = httpx.post(server.url + "/embedding", json={"content": ids}).json()
        assert np.allclose(as_ids[0]["embedding"][0], default[0]["embedding"][0], atol=1e-5)
        for bad in ({}, {"content": []}, {"content": "a", "embd_normalize": -2}):
            assert httpx.post(server.url + "/embedding", json=bad).status_code == 400, bad
    settings = ServerSettings(model=str(path), embeddings=True, pooling="none", n_threads=2)
    for server in _running(settings):
        got = httpx.post(server.url + "/embedding", json={"content": texts}).json()
        for answer, expected in zip(got, per_token, strict=True):
            assert np.allclose(answer["embedding"], expected, atol=1e-5)  # one vector a token


# -- /apply-template, /tokenize, /detokenize -----------------------------------------------------


@pytest.mark.real_model
def test_apply_template_is_the_chat_prompt(gemma_server: LiveServer, gemma: Llama) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    answer = httpx.post(gemma_server.url + "/apply-template", json={"messages": messages})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"prompt": gemma.chat_prompt(messages)}
    assert answer.json()["prompt"].endswith("<start_of_turn>model\n")
    empty = httpx.post(gemma_server.url + "/apply-template", json={"messages": []})
    assert empty.status_code == 400
    # A last assistant message is continued, as llama-server does (its "prefill").
    opened = {"role": "assistant", "content": "The answer is"}
    answer = httpx.post(gemma_server.url + "/apply-template",
                        json={"messages": [*messages, opened]})  # fmt: skip
    assert answer.json() == {"prompt": gemma.chat_prompt(messages) + "The answer is"}
    parts = {"role": "assistant", "content": [{"type": "text", "text": "The answer is"}]}
    same = httpx.post(gemma_server.url + "/apply-template", json={"messages": [*messages, parts]})
    assert same.json() == answer.json()
    # Where llama-server answers 400: the last of two is continued, and one of tool calls is
    # a finished turn, as the chat routes take them.
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for more in ([opened, opened], [{"role": "assistant", "tool_calls": [call]}]):
        answer = httpx.post(gemma_server.url + "/apply-template",
                            json={"messages": [*messages, *more]})  # fmt: skip
        assert answer.json() == {"prompt": gemma.chat_prompt([*messages, *more])}


@pytest.mark.real_model
def test_chat_continues_a_last_assistant_message(gemma_server: LiveServer) -> None:
    """As llama-server does (its default --prefill-assistant), on the prompt /apply-template
    shows: the answer goes on from the message's text. The route closed that turn and opened
    a new one (26 prompt tokens, and the model said the text again)."""
    url = gemma_server.url
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]  # fmt: skip
    prompt = httpx.post(url + "/apply-template", json={"messages": messages}).json()["prompt"]
    expected = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": 2,
                                                     "temperature": 0}).json()  # fmt: skip
    body = {"messages": messages, "max_tokens": 2, "temperature": 0}
    answer = httpx.post(url + "/v1/chat/completions", json=body).json()
    assert answer["usage"]["prompt_tokens"] == expected["tokens_evaluated"] == 21  # as native's
    assert answer["choices"][0]["message"]["content"] == expected["content"] == " Paris."
    streamed = events(httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}).text)
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in streamed if e["choices"]]
    assert "".join(deltas) == " Paris."
    shaped = httpx.post(url + "/v1/chat/completions",
                        json={**body, "response_format": {"type": "json_object"}})  # fmt: skip
    assert shaped.status_code == 400 and "prefill" in shaped.json()["error"]["message"]


@pytest.mark.real_model
def test_chat_leaves_the_answers_turn_unopened_when_asked(gemma_server: LiveServer) -> None:
    """llama-server reads ``add_generation_prompt`` from the body: false renders the chat
    without the opening of the answer's turn, the prompt /apply-template shows for it, through
    the chat methods' own keyword (tools, a response_format and media go with it). The route
    ignored it and opened the turn; then answered it with a completion of its own, which
    refused a response_format."""
    url, post = gemma_server.url, partial(httpx.post, timeout=120)  # a loaded machine is slow
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    unopened = {"messages": messages, "add_generation_prompt": False}
    prompt = post(url + "/apply-template", json=unopened).json()["prompt"]
    assert prompt.endswith("<end_of_turn>\n")
    native = {"prompt": prompt, "n_predict": 4, "temperature": 0}
    expected = post(url + "/completion", json=native).json()
    body = {**unopened, "max_tokens": 4, "temperature": 0}
    answer = post(url + "/v1/chat/completions", json=body).json()
    assert answer["usage"]["prompt_tokens"] == expected["tokens_evaluated"]
    message = answer["choices"][0]["message"]
    assert (message["role"], message["content"]) == ("assistant", expected["content"])
    opened = post(url + "/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert opened.json()["usage"]["prompt_tokens"] > expected["tokens_evaluated"]
    streamed = events(post(url + "/v1/chat/completions", json={**body, "stream": True}).text)
    deltas = [e["choices"][0]["delta"] for e in streamed if e["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == expected["content"]
    # A last assistant message is continued all the same (it opens no turn either).
    said = [*messages, {"role": "assistant", "content": "The capital of France is"}]
    continued = [
        post(
            url + "/v1/chat/completions",
            json={**body, "messages": said, "add_generation_prompt": flag},
        ).json()["choices"]
        for flag in (False, True)
    ]
    assert continued[0] == continued[1]
    shaped = post(url + "/v1/chat/completions",
                  json={**body, "response_format": {"type": "json_object"}})  # fmt: skip
    assert shaped.status_code == 200
    assert shaped.json()["usage"]["prompt_tokens"] == expected["tokens_evaluated"]
    assert shaped.json()["choices"][0]["message"]["content"].startswith("{")


# A template that reads llama-server's usual chat_template_kwargs, as Qwen 3's and gpt-oss's do.
THINKING = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    "{% if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}<assistant>"
)


def _applied(url: str, **fields: Any) -> str:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    answer = httpx.post(url + "/apply-template", json=body)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["prompt"])


def _prompt_tokens(url: str, **fields: Any) -> int:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **fields}
    answer = httpx.post(url + "/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens"])


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(tmp_path: Path) -> None:
    """llama-server's chat_template_kwargs (Qwen 3's enable_thinking) and OpenAI's
    reasoning_effort ("none": thinking off) were ignored: they are template variables."""
    path = tiny.write_tiny_llama(tmp_path / "thinking.gguf", chat_templates={"": THINKING})
    for server in _running(ServerSettings(model=str(path), n_ctx=256)):
        url, off = server.url, {"chat_template_kwargs": {"enable_thinking": False}}
        assert _applied(url) == "<user>Hi<assistant>"
        assert _applied(url, **off) == _applied(url, reasoning_effort="none")
        assert _applied(url, **off) == "<user>Hi<no-think><assistant>"
        assert _applied(url, reasoning_effort="high") == "<user>Hi[effort=high]<assistant>"
        plain = _prompt_tokens(url)
        assert _prompt_tokens(url, **off) == _prompt_tokens(url, reasoning_effort="none") > plain
        assert _prompt_tokens(url, reasoning_effort="high") > plain
        refused = httpx.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}],
            "chat_template_kwargs": {"messages": []}})  # fmt: skip
        assert refused.status_code == 400
        assert "'messages' is set by the chat itself" in refused.json()["error"]["message"]


@pytest.mark.real_model
def test_tokenize_with_pieces_round_trip(gemma_server: LiveServer) -> None:
    url = gemma_server.url
    text = "Hello world 𓀀 á"
    plain = httpx.post(url + "/tokenize", json={"content": text}).json()["tokens"]
    assert all(isinstance(t, int) for t in plain)
    pieces = httpx.post(url + "/tokenize", json={"content": text, "with_pieces": True}).json()
    assert [p["id"] for p in pieces["tokens"]] == plain
    raw = b"".join(
        bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
        for p in pieces["tokens"]
    )
    assert raw.decode() == text
    assert any(isinstance(p["piece"], list) for p in pieces["tokens"])  # the hieroglyph's bytes
    assert pieces["tokens"][0] == {"id": 9259, "piece": "Hello"}
    assert httpx.post(url + "/detokenize", json={"tokens": plain}).json() == {"content": text}
    special = httpx.post(url + "/tokenize", json={"content": "Hi", "add_special": True,
                                                  "with_pieces": True}).json()  # fmt: skip
    assert special["tokens"][0]["piece"] == "<bos>"
    # As llama-server: special tokens are parsed by default, and render as text.
    turn = httpx.post(url + "/tokenize", json={"content": "<start_of_turn>"}).json()["tokens"]
    assert len(turn) == 1
    assert httpx.post(url + "/detokenize", json={"tokens": turn}).json()["content"] == (
        "<start_of_turn>"
    )
    mixed = httpx.post(url + "/tokenize", json={"content": [2, "Hello", 1902]}).json()
    assert mixed == {"tokens": [2, 9259, 1902]}
    assert httpx.post(url + "/tokenize", json={}).json() == {"tokens": []}  # as llama-server
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.text


def test_detokenize_joins_the_pieces_as_llama_server(fim_server: LiveServer) -> None:
    # A SentencePiece vocabulary that adds a space before the text: llama_detokenize drops it
    # again, llama-server (and so its clients, which detokenize token by token) keeps it.
    url = fim_server.url
    asked = {"content": "the a", "with_pieces": True}
    pieces = httpx.post(url + "/tokenize", headers=KEY, json=asked).json()["tokens"]
    tokens = [p["id"] for p in pieces]
    joined = "".join(p["piece"] for p in pieces)
    assert joined.startswith(" ") and joined.strip() == "the a"
    answer = httpx.post(url + "/detokenize", headers=KEY, json={"tokens": tokens}).json()
    assert answer == {"content": joined}
    one_by_one = [
        httpx.post(url + "/detokenize", headers=KEY, json={"tokens": [t]}).json()["content"]
        for t in tokens
    ]
    assert "".join(one_by_one) == joined


def test_detokenize_looks_each_distinct_token_up_once(
    fim_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A million ids took 9.9 s, one token_to_bytes each.
    looked_up: list[int] = []
    one_by_one = Vocab.token_to_bytes

    def counted(vocab: Vocab, token: int, special: bool = False) -> bytes:
        looked_up.append(token)
        return one_by_one(vocab, token, special)

    for server in _running(ServerSettings(model=str(fim_path), n_ctx=256)):
        asked = {"content": "the a", "with_pieces": True}
        pieces = httpx.post(server.url + "/tokenize", json=asked).json()["tokens"]
        tokens, joined = [p["id"] for p in pieces], "".join(p["piece"] for p in pieces)
        monkeypatch.setattr(Vocab, "token_to_bytes", counted)
        answer = httpx.post(server.url + "/detokenize", json={"tokens": tokens * 50_000})
        assert answer.json() == {"content": joined * 50_000}
        assert sorted(looked_up) == sorted(set(tokens))


# -- /props --------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_props_describe_the_server(gemma_server: LiveServer, gemma_path: Path) -> None:
    props = httpx.get(gemma_server.url + "/props").json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 512  # per slot
    assert settings["params"]["temperature"] == pytest.approx(0.8)
    assert settings["params"]["top_k"] == 40 and "typ_p" in settings["params"]["samplers"]
    assert props["total_slots"] == 2
    assert props["model_path"] == str(gemma_path) and props["model_alias"] == "gemma"
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert props["build_info"].startswith("llamacrab-")
    assert props["bos_token"] == "<bos>" and props["endpoint_props"] is False
    # The template in use (it said ""): Gemma's GGUF has none, and the built-in format is
    # named, as llama-server names one given by --chat-template. Its weights' type too.
    assert props["chat_template"] == "gemma" and props["model_ftype"] == "Q4_K - Medium"
    assert props["chat_template_caps"] == {
        "supports_system_role": True, "supports_tools": False, "supports_tool_calls": False,
        "supports_object_arguments": False,
    }  # fmt: skip
    refused = httpx.post(gemma_server.url + "/props", json={})
    assert refused.status_code == 403 and "--props" in refused.text


def test_props_show_a_models_own_template(tmp_path: Path, fim_server: LiveServer) -> None:
    path = tiny.write_tiny_llama(tmp_path / "tools.gguf", chat_templates={"": TEMPLATE})
    for server in _running(ServerSettings(model=str(path), n_ctx=256)):
        props = httpx.get(server.url + "/props").json()
        assert props["chat_template"] == TEMPLATE
        caps = props["chat_template_caps"]
        assert caps["supports_tools"] is True and caps["supports_tool_calls"] is False
    # A model that cannot chat (no template, not a Gemma) shows none.
    props = httpx.get(fim_server.url + "/props", headers=KEY).json()
    assert props["chat_template"] == "" and "chat_template_caps" not in props


@pytest.mark.real_model
def test_models_list_what_llama_server_lists(gemma_server: LiveServer) -> None:
    """Its ``meta`` (tools size prompts by ``n_ctx`` and ``n_ctx_train``) and ``aliases``."""
    for path in ("/v1/models", "/models", "/v1/models/gemma"):
        answer = httpx.get(gemma_server.url + path).json()
        card = answer["data"][0] if "data" in answer else answer
        assert card["id"] == "gemma" and card["aliases"] == ["gemma"]
        assert card["meta"] == {"vocab_type": 1, "n_vocab": 262144, "n_ctx": 512,
                                "n_ctx_train": 32768, "n_embd": 640, "n_params": 268098176,
                                "size": 246587904, "ftype": "Q4_K - Medium"}  # fmt: skip


@pytest.mark.real_model
def test_post_props_with_the_flag_changes_nothing(one_slot_server: LiveServer) -> None:
    url = one_slot_server.url
    assert httpx.get(url + "/props").json()["endpoint_props"] is True
    assert httpx.post(url + "/props", json={}).json() == {"success": True}
    refused = httpx.post(url + "/props", json={"n_ctx": 99})
    assert refused.status_code == 400 and "n_ctx" in refused.json()["error"]["message"]


# -- /slots --------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_slots_list_each_slot(gemma_server: LiveServer, one_slot_server: LiveServer) -> None:
    slots = httpx.get(gemma_server.url + "/slots").json()
    assert [(s["id"], s["n_ctx"], s["is_processing"]) for s in slots] == [
        (0, 512, False), (1, 512, False)]  # fmt: skip
    assert all(s["n_prompt_tokens"] >= 0 for s in slots)
    assert httpx.get(gemma_server.url + "/slots?fail_on_no_slot=1").status_code == 200
    one = httpx.get(one_slot_server.url + "/slots").json()
    assert [(s["id"], s["n_ctx"]) for s in one] == [(0, 1024)]


def test_slot_actions_need_a_slot_save_path(fim_server: LiveServer) -> None:
    for action in ("save", "restore", "erase"):
        answer = httpx.post(fim_server.url + f"/slots/0?action={action}",
                            json={"filename": "a.bin"}, headers=KEY)  # fmt: skip
        assert answer.status_code == 501
        assert "--slot-save-path" in answer.json()["error"]["message"]


def _complete(url: str, prompt: str) -> dict[str, int]:
    answer = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4,
                                                       "temperature": 0}, timeout=60)  # fmt: skip
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    return {"prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}  # fmt: skip


def _text(url: str, prompt: str) -> tuple[str, int]:
    """A greedy answer and how many of its prompt's tokens came from a slot's memory."""
    answer = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8,
                                                       "temperature": 0}, timeout=60)  # fmt: skip
    assert answer.status_code == 200, answer.text
    body = answer.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _slot_list(url: str) -> list[dict[str, Any]]:
    slots: list[dict[str, Any]] = httpx.get(url + "/slots").json()
    return slots


def _until_idle(url: str) -> bool:
    deadline = time.monotonic() + 30
    while any(slot["is_processing"] for slot in _slot_list(url)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def slots_server(fim_path: Path, slot_dir: Path) -> Iterator[LiveServer]:
    """`llamacrab serve --parallel 3 --slot-save-path DIR` on the tiny model."""
    settings = ServerSettings(model=str(fim_path), parallel=3, n_ctx=3 * 2048, n_threads=2,
                              slot_save_path=str(slot_dir))  # fmt: skip
    yield from _running(settings)


def test_parallel_slots_save_and_restore_while_another_generates(
    slots_server: LiveServer, slot_dir: Path
) -> None:
    url = slots_server.url
    prompt = "the cat sat on the mat the dog sat on the cat"
    _complete(url, prompt)  # the prompt in a slot's memory
    expected, cached = _text(url, prompt)
    [holder] = [slot for slot in _slot_list(url) if slot["n_prompt_tokens"]]
    name = f"p-{uuid.uuid4().hex}.bin"
    saved = httpx.post(url + f"/slots/{holder['id']}?action=save", json={"filename": name})
    assert saved.status_code == 200, saved.text
    assert saved.json()["n_saved"] == holder["n_prompt_tokens"]
    assert saved.json()["n_written"] == (slot_dir / name).stat().st_size > 0
    long = {"prompt": "0123456789", "max_tokens": 4000, "min_tokens": 4000, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as generating:
        lines = generating.iter_lines()  # kept: dropping it would close the connection
        assert next(lines).startswith("data: ")  # generating now, until this client leaves
        [busy] = [slot["id"] for slot in _slot_list(url) if slot["is_processing"]]
        for action in ("save", "restore", "erase"):
            answer = httpx.post(url + f"/slots/{busy}?action={action}", json={"filename": name})
            assert answer.status_code == 409, answer.text
            error = answer.json()["error"]
            assert error["type"] == "unavailable_error" and error["code"] == "slot_busy"
            assert f"slot {busy} is generating" in error["message"]
        target = next(slot["id"] for slot in _slot_list(url)
                      if slot["id"] not in (holder["id"], busy))  # fmt: skip
        restored = httpx.post(url + f"/slots/{target}?action=restore", json={"filename": name})
        assert restored.status_code == 200, restored.text
        assert restored.json()["id_slot"] == target
        assert restored.json()["n_restored"] == saved.json()["n_saved"]
        again = httpx.post(url + f"/slots/{target}?action=save", json={"filename": "q.bin"})
        assert again.status_code == 200 and again.json()["n_saved"] == saved.json()["n_saved"]
        if holder["id"] != busy:  # the restored slot alone holds the prompt now
            erased = httpx.post(url + f"/slots/{holder['id']}?action=erase").json()
            assert erased["n_erased"] == holder["n_prompt_tokens"]
        assert _slot_list(url)[busy]["is_processing"]  # it went on meanwhile
    assert _until_idle(url)
    assert _text(url, prompt) == (expected, cached)  # from the restored slot, the same answer
    erased = httpx.post(url + f"/slots/{target}?action=erase").json()
    assert erased == {"id_slot": target, "n_erased": saved.json()["n_saved"]}  # as it was
    assert _slot_list(url)[target]["n_prompt_tokens"] == 0


def test_slot_actions_name_a_slot_and_an_action(slots_server: LiveServer) -> None:
    url = slots_server.url
    for bad in ("/slots/3?action=save", "/slots/-1?action=erase", "/slots/0?action=copy"):
        answer = httpx.post(url + bad, json={"filename": "p.bin"})
        assert answer.status_code == 400, (bad, answer.text)


def test_a_slot_file_name_held_by_a_directory_is_a_400(
    slots_server: LiveServer, slot_dir: Path
) -> None:
    # Restoring from it, or saving over it, was a 500 (IsADirectoryError).
    url = slots_server.url
    name = f"d-{uuid.uuid4().hex}.bin"
    (slot_dir / name).mkdir()
    for action in ("restore", "save"):
        answer = httpx.post(url + f"/slots/0?action={action}", json={"filename": name})
        assert answer.status_code == 400, (action, answer.text)
        error = answer.json()["error"]
        assert error["param"] == "filename" and error["code"] == "invalid_filename"
        assert "is a directory" in error["message"]
    assert (slot_dir / name).is_dir() and not any((slot_dir / name).iterdir())
    assert not [p for p in slot_dir.iterdir() if p.name.startswith(name + ".")]  # no partial


@pytest.mark.real_model
def test_a_restored_slot_reuses_its_prompt(one_slot_server: LiveServer, slot_dir: Path) -> None:
    url = one_slot_server.url
    name = f"gemma-{uuid.uuid4().hex}.bin"
    prompt = "A long story about a lighthouse keeper who finds a message in a bottle: " * 4
    first = _complete(url, prompt)
    saved = httpx.post(url + "/slots/0?action=save", json={"filename": name})
    assert saved.status_code == 200, saved.text
    body = saved.json()
    assert body["id_slot"] == 0 and body["filename"] == name
    assert body["n_saved"] >= first["prompt"] and body["timings"]["save_ms"] >= 0
    assert (slot_dir / name).stat().st_size == body["n_written"] > 0
    assert httpx.post(url + "/slots/0?action=erase").status_code == 200
    other = _complete(url, "Something else entirely.")
    assert other["cached"] <= 1  # the memory holds this prompt now, not the story
    restored = httpx.post(url + "/slots/0?action=restore", json={"filename": name})
    assert restored.status_code == 200, restored.text
    assert restored.json()["n_restored"] == body["n_saved"]
    assert restored.json()["n_read"] == body["n_written"]
    again = _complete(url, prompt)
    assert again["prompt"] == first["prompt"]
    assert again["cached"] == first["prompt"] - 1  # all but the last token, decoded for logits


@pytest.mark.real_model
def test_slot_file_names_are_plain_names(one_slot_server: LiveServer, slot_dir: Path) -> None:
    url = one_slot_server.url
    bad_names = ["../escape.bin", "/etc/passwd", "a/b.bin", "a\\b.bin", "..", ".hidden",
                 "x..y", "", "a b", "%2e%2e", "n" * 129, "evil.bin.partial", "tab\tname",
                 "caf\u00e9.bin", "name\n"]  # fmt: skip
    for name in bad_names:
        for action in ("save", "restore"):
            answer = httpx.post(url + f"/slots/0?action={action}", json={"filename": name})
            assert answer.status_code == 400, (name, action, answer.text)
            assert answer.json()["error"]["param"] == "filename"
    assert httpx.post(url + "/slots/0?action=save", json={}).status_code == 400
    assert not (slot_dir.parent / "escape.bin").exists()
    (slot_dir / "garbage.bin").write_bytes(b"not a state at all")
    corrupt = httpx.post(url + "/slots/0?action=restore", json={"filename": "garbage.bin"})
    assert corrupt.status_code == 400 and "not a llamacrab state" in corrupt.text
    missing = httpx.post(url + "/slots/0?action=restore", json={"filename": "absent.bin"})
    assert missing.status_code == 404


# -- /v1/audio/transcriptions --------------------------------------------------------------------


@pytest.mark.real_model
def test_transcriptions_need_an_audio_projector(gemma_server: LiveServer) -> None:
    wav = wav_bytes(tone(16000), 16000)
    answer = httpx.post(gemma_server.url + "/v1/audio/transcriptions",
                        files={"file": ("tone.wav", wav, "audio/wav")},
                        data={"model": "gemma"})  # fmt: skip
    assert answer.status_code == 400
    assert "audio projector" in answer.json()["error"]["message"]


@pytest.fixture(scope="module")
def hearing_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    out = tmp_path_factory.mktemp("asr")
    text = tiny.write_tiny_llama(out / "text.gguf", chat_templates={"": TEMPLATE})
    audio = mmproj.write_tiny_audio_mmproj(out / "audio.gguf")
    settings = ServerSettings(model=str(text), model_alias="tiny-asr", mmproj=str(audio),
                              n_ctx=2048, max_tokens_limit=8)  # fmt: skip
    yield from _running(settings)


def test_transcriptions_with_the_openai_sdk(hearing_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=hearing_server.url + "/v1", api_key="unused", max_retries=0)
    wav = wav_bytes(tone(16000), 16000)
    result = client.audio.transcriptions.create(model="tiny-asr", file=("tone.wav", wav),
                                                language="en", temperature=0)  # fmt: skip
    assert isinstance(result.text, str)
    assert result.usage is not None and result.usage.input_tokens > 750  # type: ignore[union-attr]
    assert result.usage.output_tokens <= 8  # type: ignore[union-attr]
    text = client.audio.transcriptions.create(model="tiny-asr", file=("tone.wav", wav),
                                              response_format="text", temperature=0)  # fmt: skip
    assert text == result.text
    stream = httpx.post(hearing_server.url + "/v1/audio/transcriptions",
                        files={"file": ("tone.wav", wav)},
                        data={"model": "tiny-asr", "stream": "true", "language": "en",
                              "temperature": "0"})  # fmt: skip
    streamed = events(stream.text)
    assert streamed[-1]["type"] == "transcript.text.done" and streamed[-1]["text"] == result.text
    deltas = "".join(str(e["delta"]) for e in streamed if e["type"] == "transcript.text.delta")
    assert deltas == result.text
    for data, files, words in [
        ({"model": "tiny-asr", "response_format": "srt"}, {"file": ("t.wav", wav)}, "srt"),
        ({"model": "tiny-asr"}, {"file": ("t.wav", b"")}, "empty"),
        ({"model": "tiny-asr"}, {"file": ("t.txt", b"hello there, not audio")}, "media"),
        ({"model": "tiny-asr"}, None, "file"),
    ]:
        answer = httpx.post(hearing_server.url + "/v1/audio/transcriptions", data=data,
                            files=files)  # fmt: skip
        assert answer.status_code == 400 and words in answer.text, answer.text
