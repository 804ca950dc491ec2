"""DRY's sequence breakers: bounded, and processed once per model and settings (each pass over
the vocabulary is one native call nothing interrupts: 100 long breakers took 19 s on Gemma)."""

from __future__ import annotations

import gc
import re
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import running

from llamacrab import InvalidParameterError, Llama, SamplingOptions
from llamacrab._native import dry_sampler, handle, sampler
from llamacrab._native.dry_breakers import processed_breakers, token_texts
from llamacrab._native.dry_sampler import (
    CACHED_PER_MODEL,
    MAX_DRY_BREAKER_BYTES,
    MAX_DRY_BREAKERS,
    MAX_DRY_PAIRS,
    MAX_DRY_TAIL_TOKENS,
)
from llamacrab.server import ServerSettings

SILLYTAVERN = ("\n", ":", '"', "*")  # its defaults, llama.cpp's too


@pytest.mark.parametrize(
    ("breakers", "message"),
    [
        (tuple("abcdefghijklmnopq"), "dry_sequence_breakers has 17 breakers; at most 16"),
        (("\n", "x" * 41), "dry_sequence_breakers: 'x+'... is 41 bytes of UTF-8; .* at most 40"),
        (("é" * 21,), "is 42 bytes of UTF-8"),  # bytes, as llama.cpp cuts them
    ],
    ids=["count", "length", "multi-byte length"],
)
def test_too_many_or_too_long_breakers_are_refused(
    tiny_llama: Llama, breakers: tuple[str, ...], message: str
) -> None:
    with pytest.raises(InvalidParameterError, match=message):
        SamplingOptions(dry_multiplier=0.8, dry_sequence_breakers=breakers)
    with pytest.raises(InvalidParameterError, match=message):
        tiny_llama.create_completion("hi", max_tokens=1, dry_multiplier=0.8,
                                     dry_sequence_breakers=breakers)  # fmt: skip


def test_breakers_at_the_bounds_are_taken(tiny_llama: Llama) -> None:
    breakers = ("é" * (MAX_DRY_BREAKER_BYTES // 2), *"abcdefghijklmno")
    assert len(breakers) == MAX_DRY_BREAKERS
    result = tiny_llama.create_completion("hi", max_tokens=2, dry_multiplier=0.8, seed=1,
                                          dry_sequence_breakers=breakers)  # fmt: skip
    assert result.usage.completion_tokens >= 1


def test_breakers_that_most_tokens_contain_are_refused_on_gemma(gemma: Llama) -> None:
    # Each breaker once: 16 x " " is one " ", which 137k of Gemma's tokens contain (llama.cpp
    # kept 2.2M pairs, 120 MiB a clone); 16 common letters, 146k tokens (631k pairs).
    for breakers in ((" ",) * 16, tuple("etaoinsrhlcdumfp")):
        with pytest.raises(InvalidParameterError, match=(
            rf"dry_sequence_breakers match 1[34]\d{{4}} \(token, rest\) pairs .* at most "
            rf"{MAX_DRY_PAIRS} pairs and {MAX_DRY_TAIL_TOKENS} tokens"
        )):  # fmt: skip
            gemma.create_completion("hi", max_tokens=1, dry_multiplier=0.8,
                                    dry_sequence_breakers=breakers)  # fmt: skip


def test_a_breaker_with_long_rests_is_bounded_by_their_tokens_on_gemma(gemma: Llama) -> None:
    # The 17k tokens that end with "e" or "eé"..., each followed by the rest: 345k tokens.
    with pytest.raises(InvalidParameterError) as refused:
        gemma.create_completion("hi", max_tokens=1, dry_multiplier=0.8,
                                dry_sequence_breakers=["e" + "é" * 19 + "x"])  # fmt: skip
    counts = re.search(r"match (\d+) .* with (\d+) tokens of rests", str(refused.value))
    assert counts is not None
    assert int(counts[1]) <= MAX_DRY_PAIRS < MAX_DRY_TAIL_TOKENS < int(counts[2])


@pytest.mark.parametrize("breakers", [
    SILLYTAVERN,
    (*SILLYTAVERN, "Seraphina", "Alice", "Bob", "Narrator", "Elizabeth", "Marcus", "Kaito",
                   "Anastasia", "Dr. Watson", "Sherlock Holmes", "Lady Catherine", "Captain"),
    (*SILLYTAVERN, "### Instruction:", "### Response:", "<start_of_turn>user", "<end_of_turn>",
                   "User:", "Assistant:", "\n\n", "</s>", "[INST]", "[/INST]", "Human:", "AI:"),
    (*SILLYTAVERN, ".", ",", "!", "?", "(", ")", "-", "'", "\u2014", "#", "\t", ";"),
], ids=["defaults", "character names", "instruct markers", "punctuation"])  # fmt: skip
def test_real_world_breakers_are_taken_on_gemma(gemma: Llama, breakers: tuple[str, ...]) -> None:
    done = processed_breakers(token_texts(gemma.model), gemma.model.vocab,
                              [b.encode() for b in breakers])  # fmt: skip
    assert len(done.heads) <= MAX_DRY_PAIRS / 3 and len(done.tails) <= MAX_DRY_TAIL_TOKENS / 3
    result = gemma.create_completion("hi", max_tokens=1, dry_multiplier=0.8,
                                     dry_sequence_breakers=breakers)  # fmt: skip
    assert result.usage.completion_tokens == 1


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_answers_400_for_breakers_past_the_bound(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    monkeypatch.setattr(dry_sampler, "MAX_DRY_PAIRS", 3)  # the tiny vocabulary: more contain "a"
    with contextmanager(running)(ServerSettings(model=str(tiny_model_path), n_ctx=256)) as server:
        body = {"prompt": "the cat", "max_tokens": 2, "dry_multiplier": 0.8, "stream": stream,
                "dry_sequence_breakers": ["a"]}  # fmt: skip
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert "at most 3 pairs" in response.json()["error"]["message"]
        body["dry_sequence_breakers"] = ["\n"]
        assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The keys of the DRY samplers built (walks over the vocabulary), in order."""
    seen: list[tuple[Any, ...]] = []
    build = dry_sampler._build

    def counted(model: Any, key: Any) -> Any:
        seen.append(key)
        return build(model, key)

    monkeypatch.setattr(dry_sampler, "_build", counted)
    return seen


def test_a_dry_sampler_is_built_once_per_model_and_settings(
    tiny_llama: Llama, builds: list[tuple[Any, ...]]
) -> None:
    def generate(multiplier: float, breakers: tuple[str, ...] = ("a", "b")) -> None:
        tiny_llama.create_completion("the cat", max_tokens=2, seed=1, dry_multiplier=multiplier,
                                     dry_sequence_breakers=breakers)  # fmt: skip

    generate(0.8)
    generate(0.8)
    assert len(builds) == 1
    generate(0.9)  # the clone carries the settings it was built with: another build
    generate(0.8, ("c",))
    assert len(builds) == 3
    for multiplier in range(1, CACHED_PER_MODEL + 1):  # pushes 0.8 with ("a", "b") out
        generate(multiplier)
    generate(0.8)
    assert len(builds) == 3 + CACHED_PER_MODEL + 1
    assert builds[-1] == builds[0]


def test_the_cached_samplers_are_freed_with_the_model(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    frees: list[str] = []
    monkeypatch.setattr(handle, "free_observer", lambda kind, at: frees.append(kind))
    llm = Llama(tiny_model_path, n_ctx=64, n_threads=1, graph_sampling="off")
    llm.create_completion("the cat", max_tokens=2, dry_multiplier=0.8)
    llm.close()
    assert frees.count("DRY sampler") == 1
    assert frees.index("DRY sampler") < frees.index("model")

    # Nor does the cache keep a model no one closed alive.
    llm = Llama(tiny_model_path, n_ctx=64, n_threads=1, graph_sampling="off")
    llm.create_completion("the cat", max_tokens=2, dry_multiplier=0.8)
    model = weakref.ref(llm.model)
    del llm
    gc.collect()
    assert model() is None
    assert frees.count("DRY sampler") == 2


def test_a_cloned_dry_sampler_penalizes_as_a_fresh_one(
    gemma: Llama, builds: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = "one two three four one two three four one two three four one two three four one"

    def tokens(**more: Any) -> list[int]:
        return gemma.create_completion(prompt, max_tokens=12, **more).choices[0].tokens

    dry = {"dry_multiplier": 5.0, "dry_sequence_breakers": ("\n", "five")}
    cloned = [tokens(temperature=0, **dry), tokens(temperature=0, **dry),
              tokens(temperature=0.9, seed=5, **dry)]  # fmt: skip
    assert len(builds) == 1
    assert cloned[0] != tokens(temperature=0)  # DRY changed the picks
    # Each chain given its own build, as before the cache:
    monkeypatch.setattr(sampler, "dry_sampler", dry_sampler._build)
    fresh = [tokens(temperature=0, **dry), tokens(temperature=0, **dry),
             tokens(temperature=0.9, seed=5, **dry)]  # fmt: skip
    assert len(builds) == 4
    assert cloned == fresh
