"""Embeddings: all-MiniLM-L6-v2 (PyPI) against sentence-transformers, batching and limits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from llamacrab import Batch, ContextOverflowError, InvalidParameterError, Llama, Model, ModelParams
from llamacrab.compat import Llama as CompatLlama
from llamacrab.server import ServerSettings
from llamacrab.server._app import create_app

from support import REPO, load_repo_module

REFERENCE = np.load(REPO / "tests" / "fixtures" / "minilm_reference.npz")


@pytest.fixture(scope="module")
def minilm_path() -> Path:
    path: Path = load_repo_module("scripts/convert_bert.py").minilm()
    return path


@pytest.fixture(scope="module")
def minilm(minilm_path: Path) -> Iterator[Llama]:
    with Llama(minilm_path, embeddings=True, n_threads=2) as llm:
        yield llm


def test_embeddings_match_sentence_transformers(minilm: Llama) -> None:
    sentences = [str(s) for s in REFERENCE["sentences"]]
    vectors = minilm.embed(sentences)
    assert vectors.shape == (len(sentences), 384) and vectors.dtype == np.float32
    cosines = np.sum(vectors * REFERENCE["vectors"], axis=1)
    assert cosines.min() >= 0.999, dict(zip(sentences, cosines.round(5), strict=True))


def test_batching_packs_many_texts_and_matches_one_at_a_time(minilm: Llama) -> None:
    sentences = [str(s) for s in REFERENCE["sentences"]]
    embedder = minilm._embeddings.embedder(256)
    lengths = [len(minilm.tokenize(s)) for s in sentences]
    packs = list(embedder.packs([[0] * n for n in lengths]))
    assert len(packs) < len(sentences) / 4  # several texts per decode
    batched = minilm.embed(sentences)
    single = np.stack([minilm.embed(s)[0] for s in sentences])
    assert np.abs(batched - single).max() < 1e-3
    small_packs = minilm.embed(sentences, pack_tokens=32)  # more, smaller decodes: same result
    assert np.abs(batched - small_packs).max() < 1e-3


def test_pack_tokens_below_one_is_refused(minilm: Llama) -> None:
    # 0 and -1 were taken as 1 (one text per decode) without a word.
    for pack_tokens in (0, -1):
        with pytest.raises(InvalidParameterError, match="pack_tokens"):
            minilm.embed(["a", "b"], pack_tokens=pack_tokens)
    assert minilm.embed(["a", "b"], pack_tokens=1).shape == (2, 384)


def test_normalization_is_optional(minilm: Llama) -> None:
    raw = minilm.embed(["Coffee or tea?"], normalize=False)
    assert not np.isclose(np.linalg.norm(raw), 1.0)
    assert np.allclose(raw / np.linalg.norm(raw), minilm.embed("Coffee or tea?"), atol=1e-6)
    with pytest.raises(InvalidParameterError, match="already pools"):
        minilm.embed("Coffee or tea?", pooling="cls")


def test_too_long_text_is_an_error_or_truncated(minilm: Llama) -> None:
    long_text = "word " * 600
    with pytest.raises(ContextOverflowError, match="text 1 has"):
        minilm.embed(["short", long_text])
    vector = minilm.embed(long_text, truncate=True)
    assert vector.shape == (1, 384) and np.isclose(np.linalg.norm(vector), 1.0)
    assert minilm.embed("still usable").shape == (1, 384)


def test_token_level_embeddings(minilm_path: Path) -> None:
    with Llama(minilm_path, embeddings=True, pooling="none", n_threads=2) as llm:
        tokens = llm.embed_tokens(["Hello world!", "A crab."])
        assert [t.shape for t in tokens] == [(5, 384), (5, 384)]
        # Mean pooling of the token vectors is what the pooled model computes.
        with Llama(minilm_path, embeddings=True, n_threads=2) as pooled:
            mean = tokens[0].mean(axis=0)
            assert np.dot(mean / np.linalg.norm(mean), pooled.embed("Hello world!")[0]) > 0.9999
        as_tokens = llm.embed(["Hello world!", "A crab."], normalize=False)
        assert isinstance(as_tokens, list)
        assert all(np.array_equal(a, b) for a, b in zip(as_tokens, tokens, strict=True))
        # Per-call pooling in numpy from the token vectors.
        with Llama(minilm_path, embeddings=True, n_threads=2) as pooled:
            native = pooled.embed(["Hello world!", "A crab."])
        assert np.abs(llm.embed(["Hello world!", "A crab."], pooling="mean") - native).max() < 1e-4
        cls = llm.embed("Hello world!", pooling="cls", normalize=False)[0]
        assert np.array_equal(cls, tokens[0][0])
        last = llm.embed("Hello world!", pooling="last", normalize=False)[0]
        assert np.array_equal(last, tokens[0][-1])
        with pytest.raises(InvalidParameterError, match="mean, cls or last"):
            llm.embed("x", pooling="rank")


def test_embeddings_need_an_embedding_context(tiny_llama: Llama) -> None:
    with pytest.raises(InvalidParameterError, match="embeddings=True"):
        tiny_llama.embed("hello")


def test_an_input_without_tokens_is_named(tmp_path: Path, minilm: Llama) -> None:
    # A model that adds no BOS gives an empty text no token: a decode of nothing has no row.
    make_tiny = load_repo_module("scripts/make_tiny_gguf.py")
    path = make_tiny.write_tiny_llama(tmp_path / "no-bos.gguf", no_end_tokens=True)
    with Llama(path, embeddings=True, pooling="mean", n_ctx=64) as llm:
        for texts, index in (([""], 0), (["a", ""], 1), ("", 0)):
            with pytest.raises(InvalidParameterError, match=f"input {index} has no tokens .* "
                               "empty text .*to which the model adds no token"):  # fmt: skip
                llm.embed(texts)
        assert llm.embed(["a", "b"]).shape == (2, 64)  # still usable
    with pytest.raises(InvalidParameterError, match=r"input 1 has no tokens .* list of token ids"):
        minilm.embed([[101, 102], []])
    assert minilm.embed([""]).shape == (1, 384)  # [CLS] [SEP]: tokens of its own


def test_long_prompt_on_a_non_causal_model_is_split_not_aborted(minilm: Llama) -> None:
    # llama.cpp asserts (aborts the process) when a non-causal batch exceeds n_ubatch.
    assert not minilm.model.causal
    with pytest.raises(ContextOverflowError):
        minilm.context.decode(_full_batch(600))


NO_HEAD = r"\(bert\) computes no logits \(no language-model head\)"


def test_an_embedding_model_refuses_to_generate(minilm: Llama, minilm_path: Path) -> None:
    """MiniLM (BERT) has no language-model head: llama.cpp leaves its logits at zero, and a
    completion answered "" (greedy) or [unusedNN] tokens (sampled)."""
    chat = [{"role": "user", "content": "hi"}]

    async def drained(stream: Any) -> list[Any]:
        return [chunk async for chunk in stream]

    calls: dict[str, Callable[[], object]] = {
        "greedy": lambda: minilm.create_completion("hello", max_tokens=4, temperature=0),
        "sampled": lambda: minilm.create_completion("hello", max_tokens=4, seed=1),
        "stream": lambda: list(minilm.stream_completion("hello", max_tokens=4)),
        "async": lambda: asyncio.run(drained(minilm.astream_completion("hello"))),
        "chat": lambda: minilm.create_chat_completion(chat, chat_format="chatml"),
        "chat stream": lambda: list(minilm.stream_chat_completion(chat, chat_format="chatml")),
        "infill": lambda: minilm.create_infill("def f(", "):"),
        "infill stream": lambda: list(minilm.stream_infill("def f(", "):")),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidParameterError, match=NO_HEAD):
            call()
            pytest.fail(f"{name} generated")
    with CompatLlama(str(minilm_path), embedding=True, chat_format="chatml",
                     verbose=False) as compat:  # fmt: skip
        with pytest.raises(InvalidParameterError, match=NO_HEAD):
            compat("hello", max_tokens=4)
        with pytest.raises(InvalidParameterError, match=NO_HEAD):
            compat.create_chat_completion(chat)
        assert len(compat.embed("hello")) == 384
    # A server started without --embeddings hands the request to the model.
    with TestClient(create_app(ServerSettings(model=str(minilm_path)), minilm)) as client:
        refused = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert refused.status_code == 400
        assert "(bert) computes no logits" in refused.json()["error"]["message"]
    assert minilm.embed("hello").shape == (1, 384)


def test_a_decoder_with_embeddings_on_still_generates(tiny_model_path: Path) -> None:
    with Llama(tiny_model_path, embeddings=True, n_ctx=64, n_threads=2) as llm:
        result = llm.create_completion("the cat", max_tokens=3, min_tokens=3, temperature=0)
        assert result.usage.completion_tokens == 3
        assert llm.embed("the cat", pooling="mean").shape == (1, llm.model.n_embd_out)


@pytest.mark.parametrize(
    ("arch", "without_embeddings", "with_embeddings"),
    [
        ("llama", True, True),
        ("lfm2", True, False),  # lfm2.cpp: its head only `if (!cparams.embeddings)`
        ("lfm2moe", True, False),  # LFM2's graph
        ("bert", False, False),
        ("wavtokenizer-dec", False, False),
    ],
)
def test_which_models_compute_logits(
    tiny_model_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    without_embeddings: bool,
    with_embeddings: bool,
) -> None:
    monkeypatch.setattr(Model, "arch", property(lambda self: arch))
    with Model.load(tiny_model_path, ModelParams(vocab_only=True)) as model:
        assert model.computes_logits(embeddings=False) is without_embeddings
        assert model.computes_logits(embeddings=True) is with_embeddings


def test_a_decoder_without_its_head_under_embeddings_refuses_to_generate_there(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LFM2's graph computes its language-model head only in a context without embeddings:
    with them on, a generation sampled from logits never written."""
    monkeypatch.setattr(Model, "arch", property(lambda self: "lfm2"))
    refusal = r"\(lfm2\) computes no logits in a context with embeddings on"
    with Llama(tiny_model_path, embeddings=True, n_ctx=64, n_threads=2) as llm:
        with pytest.raises(InvalidParameterError, match=refusal):
            llm.create_completion("the cat", max_tokens=3, temperature=0)
        chat = [{"role": "user", "content": "hi"}]
        with pytest.raises(InvalidParameterError, match=refusal):
            list(llm.stream_chat_completion(chat, chat_format="chatml", max_tokens=3))
        assert llm.embed("the cat", pooling="mean").shape == (1, llm.model.n_embd_out)
    with Llama(tiny_model_path, n_ctx=64, n_threads=2) as llm:
        result = llm.create_completion("the cat", max_tokens=3, min_tokens=3, temperature=0)
        assert result.usage.completion_tokens == 3


def _full_batch(n: int) -> Batch:
    batch = Batch(n)
    batch.set(np.full(n, 1000, dtype=np.int32), 0)
    return batch
