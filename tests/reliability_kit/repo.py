"""Modules of the repository's scripts/ folder, imported by path, so that no part of the kit
depends on scripts/ being on ``sys.path`` (the children have it there; pytest and a case run
in-process do not)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent.parent


def script(name: str) -> ModuleType:
    """``scripts/<name>.py``, imported once (under its own name, so a plain ``import`` of it
    elsewhere in the same process gets the same module)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]
