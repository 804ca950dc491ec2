"""The penalties and DRY counting the prompt (``penalize_prompt``), as llama-server's do: the
library keeps llama-cpp-python's default (generated tokens only), the server llama-server's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from live_server import LiveServer

from llamacrab import Image, Llama, RamCache, SamplerChain, SamplingOptions
from llamacrab._native.call import ffi, lib
from llamacrab._native.sampler import Samplers
from llamacrab.server import ServerSettings

from support import load_repo_module

REPEAT = "Repeat exactly: the quick brown fox jumps over the lazy dog"
COUNTING = "one two three four one two three four one two three four one"
GREEDY: dict[str, Any] = {"max_tokens": 16, "temperature": 0}
PENALTIES = [{"repeat_penalty": 1.3}, {"dry_multiplier": 0.8}]


def _text(llm: Llama, prompt: str | list[int], **options: Any) -> str:
    return llm.create_completion(prompt, **{**GREEDY, **options}).choices[0].text


@pytest.mark.parametrize("penalty", PENALTIES, ids=["repeat_penalty", "dry"])
def test_the_prompt_counts_only_when_asked(gemma: Llama, penalty: dict[str, float]) -> None:
    # Seen against llama-server: at temperature 0 with repeat_penalty 1.2 it did not repeat the
    # prompt, where llamacrab (counting its own tokens alone) did. A counting prompt goes on
    # repeating itself on any CPU's arithmetic (REPEAT's greedy answer is another repetition on
    # some, which DRY counting the prompt leaves alone): counted, the first pick is penalized.
    generated_only = _text(gemma, COUNTING, **penalty)
    assert generated_only.startswith(" two three four one")
    assert _text(gemma, COUNTING, penalize_prompt=False, **penalty) == generated_only
    assert not _text(gemma, COUNTING, penalize_prompt=True, **penalty).startswith(" two")


@pytest.mark.parametrize("window", [3, 4])
def test_the_first_pick_sees_the_last_prompt_tokens_of_its_window(
    gemma: Llama, window: int
) -> None:
    # " two" comes next; the last 3 prompt tokens (" three four one") do not hold it, 4 do.
    prompt = gemma.tokenize(COUNTING)
    gemma.create_completion(prompt, max_tokens=0)  # the prompt's logits, left to be read
    logits = gemma.context.logits(-1).copy()
    for token in set(prompt[-window:]):  # llama.cpp's repeat penalty, once per token
        logits[token] = logits[token] / 1.3 if logits[token] > 0 else logits[token] * 1.3
    top, second = np.sort(logits)[-1], np.sort(logits)[-2]
    assert top - second > 0.5  # no near-tie for the decode's arithmetic to flip
    first = gemma.create_completion(prompt, max_tokens=1, temperature=0, repeat_penalty=1.3,
                                    penalty_last_n=window, penalize_prompt=True)  # fmt: skip
    assert first.choices[0].tokens == (int(np.argmax(logits)),)
    two = gemma.tokenize(" two", add_special=False)
    assert (first.choices[0].tokens == tuple(two)) == (window == 3)


def _penalized(chain: SamplerChain, logits: np.ndarray) -> np.ndarray:
    """What the chain's samplers leave of ``logits`` (every candidate, in id order)."""
    entry = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
    candidates = np.zeros(logits.size, dtype=entry)
    candidates["id"], candidates["logit"] = np.arange(logits.size), logits
    data = ffi.from_buffer("llama_token_data[]", candidates)
    array = ffi.new("llama_token_data_array *", {"data": data, "size": logits.size, "selected": -1})
    with chain.in_flight() as pointer:
        for i in range(lib.llama_sampler_chain_n(pointer) - 1):  # all but the final pick
            lib.llama_sampler_apply(lib.llama_sampler_chain_get(pointer, i), array)
    return candidates["logit"][np.argsort(candidates["id"])]


def test_a_chain_fed_the_tail_of_a_long_prompt_penalizes_as_one_fed_all_of_it(
    gemma: Llama,
) -> None:
    # Only the last tokens within the windows are accepted (a long prompt costs no more): the
    # penalties and DRY end as they would have after accepting every token, one by one.
    rng = np.random.default_rng(5)
    prompt = rng.integers(100, 3000, 700).tolist()  # repeats, past every window
    options = SamplingOptions(temperature=0.7, repeat_penalty=1.3, presence_penalty=0.4,
                              frequency_penalty=0.2, penalty_last_n=50, dry_multiplier=0.8,
                              dry_penalty_last_n=300, top_k=0, top_p=1.0, min_p=0.0)  # fmt: skip
    logits = rng.normal(0, 3, gemma.vocab.n_tokens).astype(np.float32)
    with SamplerChain(gemma.model, options) as fed, SamplerChain(gemma.model, options) as each:
        fed.accept_prompt(prompt)
        for token in prompt:
            each.accept(token)
        changed = _penalized(fed, logits)
        assert np.array_equal(changed, _penalized(each, logits))
    assert not np.array_equal(changed, logits / 0.7)  # the penalties did change logits


def test_a_grammar_sees_none_of_the_prompt(gemma: Llama) -> None:
    # The grammar would refuse the prompt's text (capitals, a colon): it accepts none of it,
    # as llama-server's grammar does not, and still shapes the answer.
    grammar = 'root ::= [a-z ]+ "."'
    text = _text(gemma, REPEAT, repeat_penalty=1.3, grammar=grammar, penalize_prompt=True)
    assert text.endswith(".") and set(text[:-1]) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert text != _text(gemma, REPEAT, repeat_penalty=1.3, grammar=grammar)


def test_a_reused_prefix_penalizes_as_a_cold_prompt(gemma: Llama) -> None:
    # The prompt's tokens come from the request, not from what was decoded: a prefix kept in
    # memory or restored from a prompt cache counts as much as one decoded now.
    first, second = COUNTING + " five six", COUNTING + " seven eight"
    options = {"repeat_penalty": 1.3, "penalty_last_n": -1, "penalize_prompt": True}
    gemma.reset()
    _text(gemma, first, **options)
    warm = gemma.create_completion(second, **GREEDY, **options)
    assert warm.usage.cached_tokens > 10  # the shared prefix was reused
    gemma.reset()
    cold = gemma.create_completion(second, **GREEDY, **options)
    assert cold.usage.cached_tokens == 0
    assert warm.choices[0].tokens == cold.choices[0].tokens
    gemma.cache = RamCache(capacity_bytes=64 << 20)
    try:
        gemma.reset()
        _text(gemma, first, **options)  # stored
        gemma.reset()  # only the cache can help now
        restored = gemma.create_completion(second, **GREEDY, **options)
        assert restored.usage.cached_tokens > 10
        assert restored.choices[0].tokens == cold.choices[0].tokens
    finally:
        gemma.cache = None
    assert cold.choices[0].text != _text(gemma, second, repeat_penalty=1.3, penalty_last_n=-1)


def test_inside_the_graph_the_penalties_see_the_prompt_too(
    gemma_path: Path, gemma: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    # llama.cpp runs the penalties inside the compute graph, from the counts the CPU accepts:
    # the prompt is accepted before the decode that samples the first token. (top_k 1: the
    # graph's greedy pick after penalties is another matter.)
    in_graph: list[bool] = []
    bind = Samplers.bind

    def spy(self: Samplers, *args: Any) -> None:
        bind(self, *args)
        in_graph.append(self.in_graph)

    monkeypatch.setattr(Samplers, "bind", spy)
    options = {"temperature": 0.5, "top_k": 1, "repeat_penalty": 1.3, "penalize_prompt": True}
    with Llama(gemma_path, n_ctx=1024, n_threads=2, graph_sampling="on") as llm:
        graph = llm.create_completion(REPEAT, max_tokens=16, **options).choices[0].tokens
    cpu = gemma.create_completion(REPEAT, max_tokens=16, **options).choices[0].tokens
    assert in_graph == [True, False] and graph == cpu
    assert gemma.create_completion(REPEAT, **GREEDY, repeat_penalty=1.3,
                                   penalize_prompt=True).choices[0].tokens == cpu  # fmt: skip


@pytest.fixture(scope="module")
def server(gemma_path: Path) -> Iterator[LiveServer]:
    """``llamacrab serve`` as it runs by default: parallel slots."""
    live = LiveServer(ServerSettings(model=str(gemma_path), model_alias="gemma", parallel=2,
                                     n_ctx=2 * 512, n_threads=2))  # fmt: skip
    try:
        assert live.wait_until_loaded() == 200
        yield live
    finally:
        live.close()


def test_the_server_penalizes_the_prompt_as_llama_server(server: LiveServer, gemma: Llama) -> None:
    # Checked by hand against llama-server at the pin (27 greedy /completion cases with
    # repeat, presence, frequency penalties, DRY and a grammar): the same text. The library
    # with penalize_prompt (one slot) answers what the server (two slots) does. One request at
    # a time: a prompt batched after another slot's token is computed in other row groups,
    # which moved this chat prompt's logits by up to 0.9 here (llama.cpp's CPU kernels are
    # not batch-invariant; see assert_same_up_to_near_ties), enough to flip a 0.05 decision.
    messages = [{"role": "user", "content": REPEAT}]
    penalty = {"temperature": 0, "repeat_penalty": 1.3}
    requests = {
        "/v1/completions": {"prompt": REPEAT, "max_tokens": 16, **penalty},
        "/completion": {"prompt": REPEAT, "n_predict": 16, **penalty},
        "/v1/chat/completions": {"messages": messages, "max_tokens": 16, **penalty},
    }

    def post(path: str) -> dict[str, Any]:
        return dict(httpx.post(server.url + path, json=requests[path], timeout=300).json())

    answers = {path: post(path) for path in requests}
    text = _text(gemma, REPEAT, repeat_penalty=1.3, penalize_prompt=True)
    assert answers["/v1/completions"]["choices"][0]["text"] == text
    assert answers["/completion"]["content"] == text
    chat = gemma.create_chat_completion(messages, max_tokens=16, temperature=0,
                                        repeat_penalty=1.3, penalize_prompt=True)  # fmt: skip
    said = answers["/v1/chat/completions"]["choices"][0]["message"]["content"]
    assert said == chat.choices[0].message.content
    unfed = gemma.create_chat_completion(messages, max_tokens=16, temperature=0, repeat_penalty=1.3)
    assert said != unfed.choices[0].message.content


def test_a_media_prompt_feeds_its_text_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An image has no tokens to count: the text around it is accepted, in order, as
    # llama-server skips a media chunk's positions.
    tiny = load_repo_module("scripts/make_tiny_gguf.py")
    mmproj = load_repo_module("scripts/make_tiny_mmproj.py")
    text_model = tiny.write_tiny_llama(tmp_path / "text.gguf")
    projector = mmproj.write_tiny_vision_mmproj(tmp_path / "vision.gguf")
    accepted: list[list[int]] = []
    accept_prompt = SamplerChain.accept_prompt

    def spy(self: SamplerChain, tokens: Any) -> None:
        accepted.append(list(tokens))
        accept_prompt(self, tokens)

    monkeypatch.setattr(SamplerChain, "accept_prompt", spy)
    pixels = np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    with Llama(text_model, n_ctx=512, n_threads=2, mmproj=projector) as llm:
        marker = llm.media_marker
        prompt = f"the cat {marker} sat on the mat"
        llm.create_completion(prompt, media=[Image(pixels=pixels)], max_tokens=2, temperature=0,
                              repeat_penalty=1.3, penalize_prompt=True)  # fmt: skip
        before = llm.tokenize("the cat ")
        after = llm.tokenize(" sat on the mat", add_special=False)
    assert accepted and accepted[-1][: len(before)] == before
    assert accepted[-1][-len(after) :] == after
    assert all(token >= 0 for token in accepted[-1])
