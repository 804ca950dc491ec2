"""llama_model_quantize, run in a child process of its own (``llamacrab.quantize``): llama.cpp
aborts on some inputs while quantizing (a shape a block type cannot split, an architecture it
cannot describe) and gives no way to interrupt it, so the caller's process only waits for this
one and can kill it. ``python -m llamacrab._native.quantize SOURCE DEST OPTIONS`` (JSON, as
``quantize_file`` takes them) exits 0 with DEST written, or 1 with llama.cpp's reason as its
last line of stderr."""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

from llamacrab._native.backend import ensure_initialised
from llamacrab._native.call import c_path, call, ffi, lib
from llamacrab._native.logging import log_lines

_PREFIXES = ("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_")
# Flags of llama_model_quantize_params the caller may set, by their name there.
FLAGS = ("allow_requantize", "quantize_output_tensor", "pure")
# Tensor types the caller may name, by their field there (-1: llama.cpp's choice).
TYPES = ("output_tensor_type", "token_embedding_type")


@functools.cache
def file_types() -> dict[str, int]:
    """The file types llama.cpp quantizes to, by name as llama-quantize spells them (Q4_K_M,
    Q8_0, F16, ...)."""
    types = {}
    for name in dir(lib):
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                types[name.removeprefix(prefix)] = int(getattr(lib, name))
    return dict(sorted(types.items()))


# ggml types no weight is written in: integers, f64, and the dot products' own (q8_1, q8_K).
_NOT_WEIGHTS = {"i8", "i16", "i32", "i64", "f64", "q8_1", "q8_K"}


@functools.cache
def tensor_types() -> dict[str, int]:
    """ggml's tensor types a weight may be quantized to, by name (q8_0, f16, q4_K, ...)."""
    types = {}
    for index in range(lib.GGML_TYPE_COUNT):
        if lib.ggml_blck_size(index) > 0:  # 0: a number ggml no longer uses
            name = ffi.string(lib.ggml_type_name(index)).decode()
            if name not in _NOT_WEIGHTS:
                types[name] = index
    return types


def quantize_file(source: str, dest: str, options: dict[str, Any]) -> None:
    """Write ``source``'s model quantized at ``dest`` as ``options`` say (``file_type``,
    ``threads``, FLAGS, TYPES and ``tensor_types``: [regex, type] pairs); RuntimeError with
    llama.cpp's reason when it refuses."""
    ensure_initialised()  # ggml's backends, and llama.cpp's log lines read for the reason
    params = ffi.new("llama_model_quantize_params *", call("llama_model_quantize_default_params"))
    params.ftype = options["file_type"]
    params.nthread = options["threads"]
    for name in FLAGS:
        setattr(params, name, options[name])
    for name in TYPES:
        if options[name] is not None:
            setattr(params, name, options[name])
    overrides = options["tensor_types"]
    patterns = [ffi.new("char[]", pattern.encode()) for pattern, _ in overrides]
    if overrides:  # ended by a NULL pattern
        table = ffi.new("struct llama_model_tensor_override[]", len(overrides) + 1)
        for entry, pattern, (_, type_id) in zip(table, patterns, overrides, strict=False):
            entry.pattern, entry.type = pattern, type_id
        params.tt_overrides = table
    status = call("llama_model_quantize", c_path(source, "source"), c_path(dest, "dest"), params)
    if status != 0:
        raise RuntimeError(log_lines.take_errors() or f"llama_model_quantize returned {status}")


def main(argv: list[str]) -> int:
    source, dest, options = argv
    try:
        quantize_file(source, dest, json.loads(options))
    except Exception as error:  # the parent reads the reason; a traceback would hide it
        print(f"\n{error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
