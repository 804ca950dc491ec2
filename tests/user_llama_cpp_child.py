"""Child of tests/sys/test_bring_your_own.py: llamacrab over a llamacrab_sys built against a
user's llama.cpp install (put first on sys.path by the parent) generates from a model.

Usage: python tests/user_llama_cpp_child.py MODEL

Prints one JSON line: the build info, the llama.cpp files the process mapped, the tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import llamacrab_sys
from llamacrab import Llama, ModelLoadError


def main() -> None:
    with Llama(sys.argv[1], n_ctx=128, n_batch=32, n_threads=2, seed=0) as llm:
        choice = llm.create_completion("Hello", max_tokens=8, min_tokens=8, temperature=0.0)
        tokens = list(choice.choices[0].tokens)
    # Without libmtmd, a projector is refused by name instead of an AttributeError.
    refusal = ""
    if "multimodal (libmtmd)" in llamacrab_sys.build_info().unavailable_features:
        try:
            Llama(sys.argv[1], mmproj=sys.argv[1], n_ctx=64, n_threads=2).close()
        except ModelLoadError as exc:
            refusal = str(exc)
    maps = Path("/proc/self/maps").read_text().splitlines()
    mapped = {line.split()[-1] for line in maps if "/lib" in line and ".so" in line}
    print(json.dumps({
        "package": llamacrab_sys.__file__,
        "info": llamacrab_sys.build_info().as_dict(),
        "mapped": sorted(p for p in mapped if Path(p).name.startswith(("libllama", "libggml"))),
        "tokens": tokens,
        "projector_refusal": refusal,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
