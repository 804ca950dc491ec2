"""A model's suppressed tokens (GGUF tokenizer.ggml.suppress_tokens) are never sampled, by any
chain, as llama.cpp's common sampler (llama-server's) bans them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from llamacrab import Llama, SamplerChain, SamplingOptions

from support import load_repo_module

PROMPT = "the cat sat on"
# A plain greedy pick (numpy), a top_k-first chain, the whole chain in C, a grammar, a
# caller's bias lifting the suppressed tokens (it cannot), min_tokens' end ban beside them.
SETTINGS = {
    "greedy": {"temperature": 0},
    "top_k first": {"temperature": 1.0, "top_k": 40, "seed": 7},
    "whole chain": {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 7},
    "grammar": {"temperature": 0, "grammar": "root ::= [a-z ]+"},
    "caller's bias": {"temperature": 0, "logit_bias": "lift"},
    "min_tokens": {"temperature": 0, "min_tokens": 8},
}


def _write(path: Path, suppress: list[int]) -> Path:
    return load_repo_module("scripts/make_tiny_gguf.py").write_tiny_llama(
        path, suppress_tokens=suppress
    )


def _tokens(
    path: Path, settings: dict[str, object], lift: list[int], graph: str = "off"
) -> list[int]:
    options = dict(settings)
    if options.get("logit_bias") == "lift":
        options["logit_bias"] = dict.fromkeys(lift, 100.0)
    with Llama(path, n_ctx=256, n_threads=2, graph_sampling=graph) as llm:
        return list(llm.create_completion(PROMPT, max_tokens=24, **options).choices[0].tokens)


@pytest.mark.parametrize("name", SETTINGS)
def test_no_chain_samples_a_suppressed_token(tmp_path: Path, name: str) -> None:
    free = _write(tmp_path / "free.gguf", [])
    chosen = _tokens(free, SETTINGS[name], [])
    suppressed = sorted(set(chosen))
    assert suppressed, "the free model generated nothing to suppress"
    banned = _write(tmp_path / "banned.gguf", suppressed)
    tokens = _tokens(banned, SETTINGS[name], suppressed)
    assert tokens and not set(tokens) & set(suppressed), (tokens, suppressed)


def test_the_vocabulary_lists_them_and_the_chain_bans_them(tmp_path: Path) -> None:
    # llama.cpp drops ids outside the vocabulary; the rest are -inf in every chain's bias.
    path = _write(tmp_path / "banned.gguf", [5, 10**6, -3, 7])
    with Llama(path, n_ctx=64, n_threads=2) as llm:
        assert llm.model.vocab.suppressed_tokens == (5, 7)
        chain = SamplerChain(llm.model, SamplingOptions(logit_bias={5: 3.0, 9: -1.0}))
        assert chain.options.logit_bias == {5: -math.inf, 9: -1.0, 7: -math.inf}
        chain.close()
    with Llama(_write(tmp_path / "free.gguf", []), n_ctx=64) as llm:
        assert llm.model.vocab.suppressed_tokens == ()
        options = SamplingOptions(temperature=0)
        with SamplerChain(llm.model, options) as chain:
            assert chain.options is options  # nothing to merge: the caller's options as given


@pytest.mark.parametrize("name", ["greedy", "whole chain"])
def test_a_chain_inside_the_graph_bans_them_too(
    tmp_path: Path, name: str, bound: list[bool]
) -> None:
    settings = SETTINGS[name]
    chosen = _tokens(_write(tmp_path / "free.gguf", []), settings, [], graph="on")
    suppressed = sorted(set(chosen))
    tokens = _tokens(_write(tmp_path / "banned.gguf", suppressed), settings, [], graph="on")
    assert bound == [True, True]
    assert tokens and not set(tokens) & set(suppressed), (tokens, suppressed)
