"""Worker processes: each loads its own model (a Llama belongs to the process that made it).

Usage: python examples/processes.py [MODEL.gguf]
Without a model: Gemma 3 270M from PyPI.
"""

from __future__ import annotations

import multiprocessing
import sys

from llamacrab import ForkedHandleError, Llama
from llamacrab.cli import default_model

_worker_llm: Llama | None = None  # one per worker process, loaded by its initializer
_parent_llm: Llama | None = None  # the parent's, which a forked child inherits a copy of


def load_model(path: str) -> None:
    global _worker_llm
    _worker_llm = Llama(path, n_ctx=512, n_threads=1)


def answer(question: str) -> str:
    assert _worker_llm is not None, "the pool's initializer loads it"
    return _worker_llm.create_completion(question, max_tokens=8, temperature=0).text


def use_inherited() -> str:
    assert _parent_llm is not None, "set before the fork"
    try:
        return _parent_llm.create_completion("Hello", max_tokens=4).text
    except ForkedHandleError as error:
        return f"refused: {type(error).__name__}"


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else default_model()
    questions = ["The capital of France is", "The capital of Italy is"]
    # 'spawn' starts fresh interpreters: each worker gets every thread it asks for.
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(2, initializer=load_model, initargs=(path,)) as pool:
        for question, text in zip(questions, pool.map(answer, questions), strict=True):
            print(f"{question} ->{text!r}")
    # A forked child gets copies of the parent's objects, and may not use them.
    global _parent_llm
    with Llama(path, n_ctx=512) as _parent_llm:
        _parent_llm.create_completion("Hello", max_tokens=1)
        with multiprocessing.get_context("fork").Pool(1) as pool:
            print("forked child, parent's Llama:", pool.apply(use_inherited))


if __name__ == "__main__":
    main()
