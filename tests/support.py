"""Helpers shared by the test suites: repository scripts and examples as modules, a gate."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

import numpy as np

from llamacrab import CustomSampler

REPO = Path(__file__).resolve().parent.parent


def load_repo_module(relative_path: str) -> ModuleType:
    """Import a file such as scripts/make_tiny_gguf.py or examples/raw_generate.py."""
    path = REPO / relative_path
    name = "llamacrab_repo_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Gate(CustomSampler):
    """A sampler that holds the engine thread at each token until the test opens it."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def apply(self, candidates: np.ndarray) -> None:
        self.open.wait(timeout=30)
