"""Child of tests/sys/test_missing_backend.py: a GPU build's backend missing on this machine.

Usage: python tests/missing_backend_child.py MODULE_DIR MODEL

Registers the ``cuda`` backend modules in MODULE_DIR the way a CUDA build's import does (they are
stand-ins the parent compiled: one that cannot load, or one without devices), then loads MODEL
twice with n_gpu_layers=99 and generates. Prints one JSON line: the recorded missing backends,
what ``build_info()`` reports, every warning logged, the generated tokens.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import llamacrab_sys
from llamacrab import Llama
from llamacrab_sys import _backends


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


def main() -> None:
    collect = Collect()
    logging.getLogger().addHandler(collect)
    module_dir, model = Path(sys.argv[1]), sys.argv[2]
    _backends.load("cuda", module_dir, load_all=True)
    tokens = []
    for _ in range(2):
        with Llama(model, n_ctx=128, n_batch=32, n_threads=2, n_gpu_layers=99) as llm:
            choice = llm.create_completion("Hello", max_tokens=4, min_tokens=4, temperature=0.0)
            tokens.append(list(choice.choices[0].tokens))
    info = llamacrab_sys.build_info().as_dict()
    print(json.dumps({"missing": info["missing_backends"], "warnings": collect.messages,
                      "tokens": tokens}))  # fmt: skip


if __name__ == "__main__":
    main()
