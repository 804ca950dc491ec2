"""The opt-in ``llama_cpp`` alias: code that imports llama-cpp-python gets llamacrab.compat."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

# llama_cpp's submodules that llamacrab.compat provides (llama_cpp.X -> llamacrab.compat.X).
SUBMODULES = ("llama", "llama_types", "llama_grammar", "llama_speculative", "llama_cache",
              "llama_chat_format")  # fmt: skip


def install(*, force: bool = False) -> ModuleType:
    """Make ``import llama_cpp`` (and its ``llama``, ``llama_types``, ``llama_grammar``,
    ``llama_speculative`` and ``llama_cache`` submodules) import llamacrab.compat, for the rest
    of this process.

    Never done on import: call it before the code that imports llama_cpp (or run a script
    with ``python -m llamacrab.compat script.py``). When a real llama-cpp-python is
    importable (or already imported) it is left alone and this raises ImportError, unless
    ``force=True``. Returns the llamacrab.compat module."""
    compat = importlib.import_module("llamacrab.compat")
    current = sys.modules.get("llama_cpp")
    if current is compat:
        return compat
    if not force:
        real = current is not None or importlib.util.find_spec("llama_cpp") is not None
        if real:
            raise ImportError(
                "a real llama_cpp (llama-cpp-python) is importable: llamacrab.compat will not "
                "shadow it. Import llamacrab.compat directly, or pass force=True"
            )
    for name in [m for m in sys.modules if m == "llama_cpp" or m.startswith("llama_cpp.")]:
        del sys.modules[name]  # with force: the real one's modules go
    sys.modules["llama_cpp"] = compat
    for name in SUBMODULES:
        sys.modules[f"llama_cpp.{name}"] = importlib.import_module(f"llamacrab.compat.{name}")
    return compat


def uninstall() -> None:
    """Remove the alias (modules that already imported llama_cpp keep what they have)."""
    compat = sys.modules.get("llamacrab.compat")
    if compat is not None and sys.modules.get("llama_cpp") is compat:
        for name in ("llama_cpp", *(f"llama_cpp.{m}" for m in SUBMODULES)):
            sys.modules.pop(name, None)


def installed() -> bool:
    compat = sys.modules.get("llamacrab.compat")
    return compat is not None and sys.modules.get("llama_cpp") is compat
