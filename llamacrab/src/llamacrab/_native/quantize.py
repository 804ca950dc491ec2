"""llama_model_quantize, run in a child process of its own (``llamacrab.quantize``): llama.cpp
aborts on some inputs while quantizing (a shape a block type cannot split, an architecture it
cannot describe) and gives no way to interrupt it, so the caller's process only waits for this
one and can kill it. ``python -m llamacrab._native.quantize SOURCE DEST OPTIONS`` (JSON, as
``quantize_file`` takes them) exits 0 with DEST written, or 1 with llama.cpp's reason as its
last line of stderr."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from llamacrab._native.backend import ensure_initialised
from llamacrab._native.call import c_path, call, ffi, lib
from llamacrab._native.imatrix import read_imatrix
from llamacrab._native.logging import log_lines
from llamacrab._native.model import KvOverrideValue, kv_override_array

_PREFIXES = ("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_")
# Flags of llama_model_quantize_params the caller may set, by their name there.
FLAGS = ("allow_requantize", "quantize_output_tensor", "pure", "keep_split")
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
    ``threads``, FLAGS, TYPES, ``tensor_types``: [regex, type] pairs, and ``imatrix``: a
    path or None); RuntimeError with llama.cpp's reason when it refuses."""
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
    imatrix_arrays = _use_imatrix(params, options["imatrix"])
    status = call("llama_model_quantize", c_path(source, "source"), c_path(dest, "dest"), params)
    del imatrix_arrays  # what params pointed into, alive until llama.cpp returned
    if status != 0:
        raise RuntimeError(log_lines.take_errors() or f"llama_model_quantize returned {status}")


def _use_imatrix(params: Any, path: str | None) -> list[Any]:
    """Point ``params`` at the importance matrix in ``path`` (none: nothing), and record it in
    the file's metadata as llama-quantize does. Returns what the C arrays point into."""
    if path is None:
        return []
    imatrix = read_imatrix(Path(path))
    names = [ffi.new("char[]", name.encode()) for name in imatrix.entries]
    values = [np.ascontiguousarray(v, dtype=np.float32) for v in imatrix.entries.values()]
    table = ffi.new("struct llama_model_imatrix_data[]", len(names) + 1)  # ended by a NULL name
    for entry, name, data in zip(table, names, values, strict=False):
        entry.name, entry.data, entry.size = name, ffi.from_buffer("float[]", data), data.size
    params.imatrix = table
    recorded: dict[str, KvOverrideValue] = {"quantize.imatrix.file": _c_text(os.fsencode(path))}
    if imatrix.datasets:
        recorded["quantize.imatrix.dataset"] = _c_text(imatrix.datasets[0].encode())
    recorded["quantize.imatrix.entries_count"] = len(names)
    if imatrix.chunk_count > 0:
        recorded["quantize.imatrix.chunks_count"] = imatrix.chunk_count
    overrides = kv_override_array(recorded)
    params.kv_overrides = overrides
    return [names, values, table, overrides]


def _c_text(raw: bytes) -> str:
    """``raw`` as llama-quantize copies it into an override's value: to a NUL, at most 127
    bytes (UTF-8 here: bytes that are not become U+FFFD, and the cut falls between
    characters)."""
    text = raw.split(b"\0")[0].decode("utf-8", "replace")
    return text.encode()[:127].decode("utf-8", "ignore")


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
