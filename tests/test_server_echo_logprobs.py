"""/v1/completions with echo and logprobs (lm-evaluation-harness's log-likelihood request):
the server runs parallel slots, where the prompt's logprobs were refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from live_server import LiveServer, running

from llamacrab import Llama
from llamacrab.server import ServerSettings

PROMPT = "The cat sat on the mat, and the dog sat on the log."


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[LiveServer]:
    settings = ServerSettings(model=str(tiny_model_path), model_alias="tiny", n_ctx=512,
                              n_threads=1, graph_sampling="off")  # fmt: skip
    yield from running(settings)


@pytest.fixture(scope="module")
def one_slot(tiny_model_path: Path) -> Iterator[Llama]:
    with Llama(tiny_model_path, n_ctx=512, n_threads=1, graph_sampling="off") as llm:
        yield llm


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_rates_the_prompt(
    server: LiveServer, one_slot: Llama, max_tokens: int
) -> None:
    options = {"echo": True, "logprobs": 2, "max_tokens": max_tokens, "temperature": 0}
    body = {"prompt": PROMPT, **options}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    expected = one_slot.create_completion(PROMPT, **options).choices[0]  # type: ignore[arg-type]
    assert expected.logprobs is not None
    assert choice["text"] == expected.text and choice["text"].startswith(PROMPT)
    logprobs = choice["logprobs"]
    n = len(one_slot.tokenize(PROMPT))  # every prompt token, the first (a BOS) without values
    assert len(logprobs["tokens"]) == n + max_tokens
    assert logprobs["tokens"] == list(expected.logprobs.tokens)
    assert logprobs["text_offset"] == list(expected.logprobs.text_offset)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    np.testing.assert_allclose(logprobs["token_logprobs"][1:],
                               expected.logprobs.token_logprobs[1:], rtol=0, atol=1e-4)  # fmt: skip
    pairs = zip(logprobs["top_logprobs"][1:], expected.logprobs.top_logprobs[1:], strict=True)
    for got, want in pairs:
        assert want is not None and got.keys() == want.keys() and len(got) == 2
        np.testing.assert_allclose(list(got.values()), list(want.values()), rtol=0, atol=1e-4)


def test_the_openai_sdk_reads_the_prompts_logprobs(server: LiveServer, one_slot: Llama) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    result = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1,
                                       max_tokens=0)  # fmt: skip
    choice = result.choices[0]
    assert choice.text == PROMPT and choice.logprobs is not None
    logprobs = choice.logprobs
    expected = one_slot.create_completion(PROMPT, echo=True, logprobs=1, max_tokens=0)
    assert expected.choices[0].logprobs is not None
    assert logprobs.tokens == list(expected.choices[0].logprobs.tokens)
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.text_offset is not None
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.tokens)
    assert logprobs.text_offset == list(expected.choices[0].logprobs.text_offset)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for token, value, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:],
                                 logprobs.top_logprobs[1:], strict=True):  # fmt: skip
        assert value is not None and value < 0 and top is not None and len(top) == 1
        assert top.get(token, value) >= value  # the likeliest is at least as likely


def test_values_line_up_with_the_prompts_tokens_as_lm_eval_reads_them(
    server: LiveServer, one_slot: Llama
) -> None:
    # lm-evaluation-harness sends context + continuation as token ids and sums
    # token_logprobs[len(context):-1]: the continuation's own values. The prompt's tokens were
    # listed from the second on, so that slice was one token late.
    context = one_slot.tokenize("The cat sat on the")
    continuation = one_slot.tokenize(" mat today", add_special=False)
    body = {"prompt": context + continuation, "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0}  # fmt: skip
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    values = response.json()["choices"][0]["logprobs"]["token_logprobs"][len(context) : -1]
    expected = []
    for k in range(len(context), len(context) + len(continuation)):
        one_slot.reset()
        one_slot.create_completion(body["prompt"][:k], max_tokens=0)
        logits = one_slot.context.logits().astype(np.float64)
        shifted = logits - logits.max()
        expected.append(shifted[body["prompt"][k]] - np.log(np.exp(shifted).sum()))
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-3)


def test_a_prompt_of_special_tokens_alone_is_rated_too(server: LiveServer, one_slot: Llama) -> None:
    # Its text is empty: the echo (and with it every prompt value) was left out.
    vocab = one_slot.vocab
    special = [vocab.bos, vocab.eos, vocab.bos, vocab.eos]
    assert None not in special and one_slot.detokenize(special) == ""
    body = {"prompt": special, "echo": True, "logprobs": 1, "max_tokens": 0}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs is not None and len(logprobs["token_logprobs"]) == len(special)
    assert logprobs["token_logprobs"][0] is None
    assert all(value is not None and value <= 0 for value in logprobs["token_logprobs"][1:])
