"""Parallel slots: several threads generate at once, batched into shared llama.cpp decodes.

Usage: python examples/parallel.py [MODEL.gguf]
Without a model: Gemma 3 270M from PyPI.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

from llamacrab import Llama
from llamacrab.cli import default_model

QUESTIONS = [f"Name one fact about the number {i}." for i in range(4)]


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else default_model()
    # 4 slots of 512 tokens each; an engine thread decodes all running generations together.
    with Llama(path, n_ctx=4 * 512, parallel=4) as llm:
        started = time.perf_counter()
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            answers = list(pool.map(
                lambda q: llm.create_completion(q, max_tokens=32, temperature=0), QUESTIONS
            ))  # fmt: skip
        seconds = time.perf_counter() - started
        for question, answer in zip(QUESTIONS, answers, strict=True):
            print(f"{question} ->{answer.text[:60]!r}")
        tokens = sum(a.usage.completion_tokens for a in answers)
        print(f"{len(QUESTIONS)} completions at once: {tokens} tokens in {seconds:.1f} s")

        stream = llm.stream_completion("Count slowly: one,", max_tokens=None)
        print("first chunk:", repr(next(stream).text))
        stream.cancel()  # from any thread; the stream ends with a "cancelled" chunk
        print("finish:", [chunk.finish_reason for chunk in stream][-1])


if __name__ == "__main__":
    main()
