"""Where the llama.cpp libraries are, and, on Windows, telling the DLL loader before _native loads.

Linux and macOS find them through the compiled module's rpath. Windows has no rpath, and since
Python 3.8 an extension's DLL dependencies are looked for only beside the application, in the
system directories and in directories added with os.add_dll_directory, so importing this module
adds the library directory there: it must come before anything that imports _native.
"""

from __future__ import annotations

import json
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Any

# The shipped libraries (a user's llama.cpp install, LLAMACRAB_LLAMA_CPP_PREFIX, is recorded).
LIBRARY_DIR = Path(__file__).resolve().parent / "lib"


def load_recorded() -> dict[str, Any]:
    """_build_info.json as the build wrote it."""
    text = resources.files("llamacrab_sys").joinpath("_build_info.json").read_text()
    recorded: dict[str, Any] = json.loads(text)
    return recorded


def library_dir(recorded: dict[str, Any]) -> Path:
    return Path(recorded.get("library_dir", LIBRARY_DIR))


def module_dir(recorded: dict[str, Any]) -> Path:
    """Where dlopen-only backend modules are looked for (the library directory by default)."""
    return Path(recorded.get("module_dir", library_dir(recorded)))


def add_dll_directories() -> list[Any]:
    """Windows: make the library directory and the backend module directory searched."""
    if sys.platform != "win32":  # the rpath does it
        return []
    recorded = load_recorded()
    directories = {library_dir(recorded), module_dir(recorded)}
    # Kept: closing one of these handles takes its directory out of the search again.
    return [os.add_dll_directory(str(path)) for path in sorted(directories) if path.is_dir()]


_added = add_dll_directories()
