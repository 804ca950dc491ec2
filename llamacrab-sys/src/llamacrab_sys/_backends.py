"""Load the backends a build was made for, and say which one this machine cannot use, and why.

A GPU build imports and runs on the CPU where its GPU is missing: a dlopen-only backend module
(GGML_BACKEND_DL) whose driver library is absent fails to load, and a loaded or linked backend
may find no device. Either way the reason is recorded (``build_info().missing_backends``) and
logged once as a warning on the ``llamacrab_sys`` logger.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llamacrab_sys import _cuda_runtime
from llamacrab_sys._callbacks import log_handler, set_log_handler
from llamacrab_sys._native import ffi, lib

logger = logging.getLogger("llamacrab_sys")

# Our backend name -> the name its ggml registry reports.
REGISTRY_NAMES = {"cuda": "CUDA", "hip": "ROCm", "vulkan": "Vulkan", "metal": "MTL",
                  "opencl": "OpenCL", "blas": "BLAS"}  # fmt: skip

_missing: dict[str, str] = {}


def missing() -> dict[str, str]:
    """Backends this build has but this process cannot use: name -> reason."""
    return dict(_missing)


@contextlib.contextmanager
def _ggml_errors() -> Iterator[list[str]]:
    """Collect the error lines ggml logs inside the block (instead of printing them)."""
    errors: list[str] = []
    previous = log_handler()

    def collect(level: int, text: str) -> None:
        if level == lib.GGML_LOG_LEVEL_ERROR and text.strip():
            errors.append(text.strip())

    set_log_handler(collect)
    try:
        yield errors
    finally:
        set_log_handler(previous)


def module_file(backend: str) -> str:
    """The file name of ``backend``'s dlopen-only module, as ggml looks for it (its
    backend_filename_prefix and _extension: no ``lib`` and ``.dll`` on Windows, else ``.so``,
    macOS included)."""
    if sys.platform == "win32":
        return f"ggml-{backend}.dll"
    return f"libggml-{backend}.so"


def _registry(name: str) -> Any:
    """The registered ggml backend called ``name`` (a ggml_backend_reg_t), or None."""
    for i in range(lib.ggml_backend_reg_count()):
        reg = lib.ggml_backend_reg_get(i)
        if ffi.string(lib.ggml_backend_reg_name(reg)).decode().lower() == name.lower():
            return reg
    return None


def _diagnose(backend: str, module_dir: Path | None, errors: list[str]) -> str | None:
    """Why ``backend`` is unusable in this process (None when it has a device).

    A module that failed to load is loaded once more through ggml, which then logs the loader's
    reason (ggml's release builds load silently the first time).
    """
    name = REGISTRY_NAMES.get(backend, backend)
    module = None if module_dir is None else module_dir / module_file(backend)
    reg = _registry(name)
    if reg is None and module is not None and module.is_file():
        lib.ggml_backend_load(str(module).encode())
        reg = _registry(name)
    if reg is not None and lib.ggml_backend_reg_dev_count(reg) > 0:
        return None
    if reg is not None:
        reason = f"the {name} backend found no device"
    elif module is not None and not module.is_file():
        reason = f"no {name} backend module at {module}"
    else:
        reason = f"the {name} backend module failed to load"
    detail = "; ".join(errors)
    return f"{reason}: {detail}" if detail else reason


def load(backend: str, module_dir: Path | None, load_all: bool) -> None:
    """Register the build's backends (``load_all``: dlopen the modules in ``module_dir``) and
    record, with one warning, a GPU backend this machine cannot use."""
    # ggml's errors while a GPU backend registers (its runtime finding no device logs why)
    # explain why it is missing; they are collected rather than printed to stderr.
    expected = backend != "cpu"
    collecting: contextlib.AbstractContextManager[list[str]] = (
        _ggml_errors() if expected else contextlib.nullcontext([])
    )
    with collecting as errors:
        if load_all and module_dir is not None:
            if backend == "cuda":
                _cuda_runtime.preload()  # from the nvidia-* wheels, before the module needs them
            lib.ggml_backend_load_all_from_path(str(module_dir).encode())
        reason = _diagnose(backend, module_dir if load_all else None, errors) if expected else None
    if reason is not None and backend not in _missing:
        _missing[backend] = reason
        logger.warning("%s; running on the CPU", reason)
