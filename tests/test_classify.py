"""Sequence classification: a classifier's labels and probabilities, and rank pooling refused
where the model's head would not give what llama.cpp reads (an abort, or other texts' values)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from test_crash_proof import assert_clean_exit, run_child

from llamacrab import InvalidParameterError, Llama
from llamacrab._features.embeddings import rerank_tokens

from support import load_repo_module

LABELS = ("negative", "neutral", "positive")
TEXTS = ["the cat sat on the mat", "a crab", "what is the capital of france ?", "the sea"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Llama]:
    convert = load_repo_module("scripts/convert_bert.py")
    out = tmp_path_factory.mktemp("classify") / "tiny-classifier.gguf"
    with Llama(convert.write_tiny_reranker(out, labels=LABELS), embeddings=True) as llm:
        yield llm


def test_each_text_gets_every_label_with_its_probability(classifier: Llama) -> None:
    assert classifier.model.classifier_labels == LABELS
    results = classifier.classify(TEXTS)
    rows = classifier.embed(TEXTS, normalize=False)
    assert rows.shape == (len(TEXTS), len(LABELS))
    for i, (result, row) in enumerate(zip(results, rows, strict=True)):
        assert result.index == i and sorted(result.labels) == sorted(LABELS)
        by_label = dict(zip(result.labels, result.scores, strict=True))
        assert [by_label[label] for label in LABELS] == pytest.approx(row.tolist(), abs=1e-6)
        expected = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        assert result.label == LABELS[int(np.argmax(row))]
        probabilities = dict(zip(result.labels, result.probabilities, strict=True))
        assert [probabilities[label] for label in LABELS] == pytest.approx(expected.tolist())
        assert list(result.probabilities) == sorted(result.probabilities, reverse=True)
    # Batched as one decode or each alone: the same outputs.
    alone = [classifier.classify(text)[0] for text in TEXTS]
    for batched, single in zip(results, alone, strict=True):
        assert batched.labels == single.labels
        assert batched.scores == pytest.approx(single.scores, abs=1e-5)


def test_a_pair_is_laid_out_as_a_reranker_s_query_and_document(classifier: Llama) -> None:
    pair = ("what is a crab ?", "a crab")
    result = classifier.classify([pair])[0]
    row = classifier.embed([rerank_tokens(classifier.model, *pair)], normalize=False)[0]
    by_label = dict(zip(result.labels, result.scores, strict=True))
    assert [by_label[label] for label in LABELS] == pytest.approx(row.tolist(), abs=1e-6)
    for bad in ([5], [("a", "b", "c")], [None]):
        with pytest.raises(InvalidParameterError, match="texts must be a string or a list"):
            classifier.classify(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match=r"text 1 to classify is a pair of \('a', 5\)"):
        classifier.classify(["a", ("a", 5)])  # type: ignore[list-item]


def test_a_reranker_s_one_output_gets_a_sigmoid(tmp_path: Path) -> None:
    convert = load_repo_module("scripts/convert_bert.py")
    path = convert.write_tiny_reranker(tmp_path / "ranker.gguf")
    with Llama(path, embeddings=True) as llm:
        assert llm.model.classifier_labels == ("0",)  # unnamed: its index, as llama.cpp prints
        (result,) = llm.classify([("what is a crab ?", "a crab")])
        (ranked,) = llm.rerank("what is a crab ?", ["a crab"])
        assert result.labels == ("0",) and result.scores[0] == pytest.approx(ranked.score)
        assert result.probabilities[0] == pytest.approx(1 / (1 + math.exp(-ranked.score)))


def test_classifying_needs_rank_pooling(classifier: Llama) -> None:
    with (
        Llama(classifier.model.path, embeddings=True, pooling="cls") as llm,
        pytest.raises(InvalidParameterError, match='pooling="rank"'),
    ):
        llm.classify("a crab")


def _llama_with_labels(path: Path, labels: int, rank: bool) -> Path:
    """The tiny llama (no classification head) naming ``labels`` classifier outputs."""
    tiny = load_repo_module("scripts/make_tiny_gguf.py")
    writer = gguf.GGUFWriter(str(path), "llama")
    tiny._metadata(writer, tiny.N_LAYER, 1e-5)
    writer.add_classifier_output_labels([f"class {i}" for i in range(labels)])
    if rank:
        writer.add_pooling_type(gguf.PoolingType.RANK)
    tiny.write_gguf(writer, tiny._tensors(0, len(tiny.vocabulary(False)[0])))
    return path


RANK_WITHOUT_A_HEAD = r"""
    import sys
    from llamacrab import Llama, LlamaError
    pooling = sys.argv[2]
    try:
        with Llama(sys.argv[1], embeddings=True, n_ctx=128, pooling=pooling) as llm:
            print("ran", llm.embed(["the cat", "a dog"], normalize=False).shape)
    except LlamaError as error:
        print(type(error).__name__, error)
"""


@pytest.mark.parametrize("labels", [1, 5, 65, 200])
def test_rank_pooling_without_a_head_is_refused_not_an_abort(tmp_path: Path, labels: int) -> None:
    # llama.cpp copies n_cls_out floats a sequence out of the hidden states at that stride:
    # past the 64-wide row (65 labels and up) an abort (GGML_ASSERT "tensor read out of
    # bounds"), within it the next text's values.
    asked_path = _llama_with_labels(tmp_path / "a.gguf", labels, rank=False)
    asked = run_child(RANK_WITHOUT_A_HEAD, str(asked_path), "rank")
    assert_clean_exit(asked)
    assert asked.stdout.startswith("InvalidParameterError"), asked.stdout
    assert "no classification head" in asked.stdout
    declared_path = _llama_with_labels(tmp_path / "b.gguf", labels, rank=True)
    declared = run_child(RANK_WITHOUT_A_HEAD, str(declared_path), "unspecified")
    assert_clean_exit(declared)
    assert declared.stdout.startswith("InvalidModelError"), declared.stdout
    assert "pooling type is rank" in declared.stdout
    with Llama(tmp_path / "b.gguf", embeddings=True, n_ctx=128, pooling="mean") as llm:
        assert llm.embed(["the cat"]).shape == (1, 64)  # another pooling: usable as it is


def test_a_prototype_classifier_picks_the_nearest_description(tmp_path: Path) -> None:
    # all-MiniLM-L6-v2 with a head of the descriptions' embeddings: a text's class is the
    # description its sentence embedding is nearest to (the head's pooling is the mean).
    convert = load_repo_module("scripts/convert_bert.py")
    classes = {"cooking": "Boiling pasta in the kitchen.", "sports": "The team won the match.",
               "weather": "Rain and wind tomorrow."}  # fmt: skip
    texts = ["Bake the bread for an hour.", "A goal in the last minute.", "A storm is coming.",
             "The crab walked sideways."]  # fmt: skip
    path = convert.prototype_classifier(classes, tmp_path / "topics.gguf")
    with Llama(convert.minilm(), embeddings=True) as minilm:
        cosines = minilm.embed(texts) @ minilm.embed(list(classes.values())).T
    with Llama(path, embeddings=True) as llm:
        assert llm.model.classifier_labels == tuple(classes)
        results = llm.classify(texts)
    for result, row in zip(results, cosines, strict=True):
        assert result.label == list(classes)[int(np.argmax(row))]
        by_label = dict(zip(result.labels, result.scores, strict=True))
        scores = np.array([by_label[label] for label in classes])
        # Each score is the cosine times one factor per text (its mean vector's length).
        factor = float(scores @ row / (row @ row))
        assert factor > 0
        assert scores == pytest.approx(factor * row, abs=1e-3 * float(np.abs(scores).max()))
