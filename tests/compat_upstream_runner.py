"""Runs LangChain's own llama.cpp tests (unchanged, from its sdist) with pytest on the
``llama_cpp`` alias of llamacrab.compat, in its own process and working directory:

    python compat_upstream_runner.py MODEL.gguf SDIST_ROOT FOLDER... -- PYTEST_ARGS...

The working directory gets the files their ``get_model()`` would download (the model a link
to MODEL, the others empty), so it downloads nothing; the chat test's placeholder path loads
MODEL too. FOLDERs (the frameworks, the test tools) go after this environment's packages.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

MODEL, SDIST_ROOT = sys.argv[1], sys.argv[2]
split = sys.argv.index("--")
sys.path.extend(sys.argv[3:split])

import pytest  # noqa: E402

import llamacrab.compat  # noqa: E402

# The names get_model() checks for in the working directory before it downloads them.
DOWNLOADS = ("ggml-alpaca-7b-q4.bin", "tokenizer.model", "convert-unversioned-ggml-to-ggml.py")
CHAT_PLACEHOLDER = "/path/to/Meta-Llama-3.1-8B-Instruct.Q4_K_M.gguf"

for name in DOWNLOADS:
    path = Path(name)
    if not path.exists():
        path.symlink_to(MODEL) if name.endswith(".bin") else path.touch()

llamacrab.compat.install()  # what a user of LangChain adds: the tests stay as shipped
_load = llamacrab.compat.Llama.__init__


def _mapped(self: llamacrab.compat.Llama, model_path: Any, *args: Any, **kwargs: Any) -> None:
    mapped = MODEL if os.fspath(model_path) == CHAT_PLACEHOLDER else model_path
    _load(self, mapped, *args, **kwargs)


llamacrab.compat.Llama.__init__ = _mapped  # type: ignore[method-assign]
sys.exit(pytest.main(["--rootdir", SDIST_ROOT, *sys.argv[split + 1 :]]))
