"""Calling llamacrab_sys.lib from tests: shim error checking and model loading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llamacrab_sys import ffi, lib


class ShimError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


def checked(function: Any, *args: Any) -> Any:
    """Call a safe_ shim; raise ShimError if the C++ side threw."""
    err = ffi.new("llamacrab_error *")
    result = function(*args, err)
    if err.code != lib.LLAMACRAB_OK:
        raise ShimError(err.code, ffi.string(err.message).decode())
    return result


def load_model(path: Path, **params: Any) -> Any:
    model_params = lib.llama_model_default_params()
    for key, value in params.items():
        setattr(model_params, key, value)
    model = checked(lib.safe_llama_model_load_from_file, str(path).encode(), model_params)
    assert model != ffi.NULL, f"llama.cpp could not load {path}"
    return model
