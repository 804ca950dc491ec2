"""Reranking with a generated BERT cross-encoder: batching, pair layout, ordering and top_n."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llamacrab import InvalidParameterError, Llama
from llamacrab._features.embeddings import rerank_tokens

from support import load_repo_module

DOCUMENTS = ["the cat sat on the mat", "paris is the capital of france", "a crab", "the sea",
             "what is a dog", "the city of paris", "cats", "the dog sat on a crab"]  # fmt: skip


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Llama]:
    convert = load_repo_module("scripts/convert_bert.py")
    path = convert.write_tiny_reranker(tmp_path_factory.mktemp("rerank") / "tiny-reranker.gguf")
    with Llama(path, embeddings=True, n_threads=2) as llm:
        yield llm


def test_pairs_are_laid_out_like_llama_server(reranker: Llama) -> None:
    vocab = reranker.vocab
    tokens = rerank_tokens(reranker.model, "what is a crab?", "a crab")
    cls, sep = vocab.tokenize("", add_special=True)  # [CLS] [SEP]
    assert tokens == [cls, *vocab.tokenize("what is a crab?", add_special=False), sep,
                      *vocab.tokenize("a crab", add_special=False)]  # fmt: skip


def test_batched_scores_equal_one_at_a_time(reranker: Llama) -> None:
    batched = reranker.rerank("what is a crab?", DOCUMENTS)
    assert len(next(reranker._embeddings.embedder(256).packs([[0] * 10] * len(DOCUMENTS)))) > 1
    single = {d: reranker.rerank("what is a crab?", [d])[0].score for d in DOCUMENTS}
    for result in batched:
        assert result.score == pytest.approx(single[result.document], abs=2e-3)  # float noise


def test_results_are_sorted_with_their_indices_and_cut_at_top_n(reranker: Llama) -> None:
    results = reranker.rerank("the capital of france", DOCUMENTS)
    assert sorted(r.index for r in results) == list(range(len(DOCUMENTS)))
    assert [r.score for r in results] == sorted((r.score for r in results), reverse=True)
    assert all(DOCUMENTS[r.index] == r.document for r in results)
    top = reranker.rerank("the capital of france", DOCUMENTS, top_n=3)
    assert [r.index for r in top] == [r.index for r in results[:3]]
    assert reranker.rerank("x", DOCUMENTS, top_n=0) == []
    with pytest.raises(InvalidParameterError, match="top_n"):
        reranker.rerank("x", DOCUMENTS, top_n=-1)


def test_reranking_needs_rank_pooling(tiny_model_path: Path) -> None:
    with (
        Llama(tiny_model_path, embeddings=True, pooling="mean", n_ctx=64) as llm,
        pytest.raises(InvalidParameterError, match="rank"),
    ):
        llm.rerank("q", ["d"])


PAST_THE_POSITION_TABLE = """
import sys
from llamacrab import Batch, ContextOverflowError, InvalidParameterError, Llama
with Llama(sys.argv[1], embeddings=True, n_threads=1) as llm:
    rows = llm.model.position_rows
    long = "the cat " * rows  # more tokens than the table has positions
    for call in (lambda: llm.rerank("q", [long]), lambda: llm.embed(long)):
        try:
            call()
        except ContextOverflowError as error:
            print("refused:", error)
    print("truncated:", llm.embed(long, truncate=True).shape)
    batch = Batch(1, 1)  # the raw path: a position past the table in a batch of its own
    batch.set_one(5, rows + 3)
    try:
        llm.context.decode(batch)
    except ContextOverflowError as error:
        print("refused:", error)
    try:  # and one before it: row -1
        batch.set_one(5, -1)
        llm.context.decode(batch)
    except InvalidParameterError as error:
        print("refused:", error)
    print("rows:", rows, "cells:", llm.context.n_ctx)
"""


def test_a_position_outside_the_learned_position_table_is_refused_not_an_abort(
    tmp_path: Path,
) -> None:
    # A BERT model's positions come from a table of n_ctx_train rows; the context is padded to
    # 256 cells, so an 83-token text on this 64-row reranker read outside it: SIGABRT in
    # ggml_get_rows (GGML_ASSERT(i01 >= 0 && i01 < ne01), found by a hostile-input hunt).
    import subprocess
    import sys

    path = load_repo_module("scripts/convert_bert.py").write_tiny_reranker(tmp_path / "r.gguf")
    child = subprocess.run([sys.executable, "-c", PAST_THE_POSITION_TABLE, str(path)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    lines = child.stdout.splitlines()
    assert sum(line.startswith("refused:") for line in lines) == 4, child.stdout
    assert "the model's position table holds 64" in lines[0]
    assert "position 67 is past this model's learned position table (64" in lines[-3]
    assert "position -1 is negative" in lines[-2]  # was SIGABRT in ggml_get_rows too
    rows, cells = (int(word) for word in lines[-1].split()[1::2])
    assert rows == 64 < cells
    assert lines[-4].startswith("truncated:")
