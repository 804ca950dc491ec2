"""Sequence classification: each text's labels, most likely first, with their probabilities.

Usage: python examples/classify.py [CLASSIFIER.gguf]
Without a classifier (any GGUF with a classification head and labels: a BERT sentiment
model, a Qwen3 reranker, ...) it makes a zero-shot topic classifier from all-MiniLM-L6-v2,
whose head holds the embeddings of the topics' descriptions (scripts/convert_bert.py).
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

from llamacrab import Llama

REPO = Path(__file__).resolve().parent.parent
TOPICS = {
    "cooking": "A recipe: cooking food in the kitchen, baking bread, boiling pasta.",
    "sports": "A sports match: the team scored a goal and won the football game.",
    "computing": "Computer programming: writing software code in Python.",
}
TEXTS = [
    "Stir the sauce and let it simmer for ten minutes.",
    "The striker kicked the ball into the net in the final minute.",
    "This function returns a list of the file names in a folder.",
]


def prototype_classifier(out: Path) -> Path:
    spec = importlib.util.spec_from_file_location(
        "convert_bert", REPO / "scripts" / "convert_bert.py"
    )
    assert spec is not None and spec.loader is not None
    convert_bert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert_bert)
    return convert_bert.prototype_classifier(TOPICS, out)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = sys.argv[1] if len(sys.argv) > 1 else prototype_classifier(Path(tmp) / "topics.gguf")
        with Llama(path, embeddings=True) as llm:  # the model's pooling: rank
            print("labels:", ", ".join(llm.model.classifier_labels))
            for result in llm.classify(TEXTS):
                best = ", ".join(
                    f"{label} {p:.2f}"
                    for label, p in zip(result.labels, result.probabilities, strict=True)
                )
                print(f"{result.label:>9}  ({best})  {TEXTS[result.index]}")


if __name__ == "__main__":
    main()
