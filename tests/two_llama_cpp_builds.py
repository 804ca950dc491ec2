"""Child of tests/test_ffi_traps.py (duplicate symbols): llamacrab and llama-cpp-python, each with
its own compiled llama.cpp, generate greedily from one model in one interpreter.

Usage: python tests/two_llama_cpp_builds.py ORDER MODEL PEER_DIR
ORDER: ``llamacrab-first`` or ``peer-first`` (which package loads its libraries first);
PEER_DIR: the compiled llama-cpp-python (scripts/peer_compiled.py), appended to sys.path so
that this environment's numpy and jinja2 are the ones imported.

Prints one JSON line: each side's prompt and generated tokens and text, and which files the
process has mapped for libllama and libggml*. The parent runs this under LD_DEBUG=bindings to
see which library every symbol of every library was bound to.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

PROMPT = "The capital of France is"
TOKENS = 12


def ours(model: str) -> dict[str, Any]:
    from llamacrab import Llama

    # Flash attention off, as llama-cpp-python 0.3.36 has it by default: the two kernels round
    # differently, and on a CPU with AMX their greedy answers part at a near tie (token 4).
    with Llama(model, n_ctx=256, n_threads=2, seed=0, flash_attn="off") as llm:
        prompt = llm.tokenize(PROMPT)
        choice = llm.create_completion(prompt, max_tokens=TOKENS, min_tokens=TOKENS,
                                       temperature=0.0).choices[0]  # fmt: skip
        return {"prompt": prompt, "tokens": list(choice.tokens), "text": choice.text}


def theirs(model: str) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=256, n_threads=2, seed=0, verbose=False)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True)
    tokens = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0):
        tokens.append(token)
        if len(tokens) == TOKENS:
            break
    text = llm.detokenize(tokens).decode("utf-8", "replace")
    llm.close()
    return {"prompt": prompt, "tokens": tokens, "text": text}


def mapped_libraries() -> list[str]:
    paths = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[-1] if len(line.split()) >= 6 else ""
        if Path(path).name.startswith(("libllama", "libggml")):
            paths.add(path)
    return sorted(paths)


def main() -> None:
    order, model, peer = sys.argv[1], sys.argv[2], sys.argv[3]
    sys.path.append(peer)
    packages = ["llamacrab", "llama_cpp"]
    if order == "peer-first":
        packages.reverse()
    for package in packages:  # importing each loads its libraries
        importlib.import_module(package)
    llama_cpp = sys.modules["llama_cpp"]
    llamacrab_sys = importlib.import_module("llamacrab_sys")

    result = {
        "order": order,
        "ours_dir": str(llamacrab_sys.build_info().library_dir),
        "peer_dir": str(Path(llama_cpp.__file__).parent / "lib"),
    }
    first, second = (ours, theirs) if order == "llamacrab-first" else (theirs, ours)
    result[first.__name__] = first(model)
    result[second.__name__] = second(model)
    result["mapped"] = mapped_libraries()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
