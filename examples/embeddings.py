"""Sentence embeddings with all-MiniLM-L6-v2 (converted to GGUF from the PyPI package), batched.

Usage: python examples/embeddings.py [MODEL.gguf]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from llamacrab import Llama

REPO = Path(__file__).resolve().parent.parent


def default_model() -> str:
    # scripts/convert_bert.py converts the model once into the llamacrab cache.
    command = [sys.executable, str(REPO / "scripts" / "convert_bert.py")]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else default_model()
    documents = [
        "Crabs walk sideways.",
        "Paris is the capital of France.",
        "Python is a programming language.",
    ]
    with Llama(path, embeddings=True) as llm:  # many texts are packed into each decode
        vectors = llm.embed(documents)  # (3, 384), L2-normalized
        query = llm.embed("Which city is France's capital?")[0]
    scores = vectors @ query
    for index in np.argsort(-scores):
        print(f"{scores[index]:.3f}  {documents[index]}")


if __name__ == "__main__":
    main()
