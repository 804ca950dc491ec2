"""Modules of the repository's scripts/ folder, imported by path, so that no part of the kit
depends on scripts/ being on ``sys.path`` (the children have it there; pytest and a case run
in-process do not)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
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


def made_once(
    workdir: Path, pattern: str, writers: dict[str, Callable[[Path], object]]
) -> dict[str, str]:
    """``workdir / pattern.format(key)`` for each key of ``writers``, written by its writer
    (one of the scripts' generators) when it is not there yet."""
    workdir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for key, write in writers.items():
        path = workdir / pattern.format(key)
        if not path.exists():
            write(path)
        paths[key] = str(path)
    return paths
