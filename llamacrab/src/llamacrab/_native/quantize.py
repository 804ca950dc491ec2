"""llama_model_quantize, run in a child process of its own (``llamacrab.quantize``): llama.cpp
aborts on some inputs while quantizing (a shape a block type cannot split, an architecture it
cannot describe) and gives no way to interrupt it, so the caller's process only waits for this
one and can kill it. ``python -m llamacrab._native.quantize SOURCE DEST TYPE THREADS FLAGS``
exits 0 with DEST written, or 1 with llama.cpp's reason as its last line of stderr."""

from __future__ import annotations

import functools
import json
import sys

from llamacrab._native.backend import ensure_initialised
from llamacrab._native.call import c_path, call, ffi, lib
from llamacrab._native.logging import log_lines

_PREFIXES = ("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_")
# Flags of llama_model_quantize_params the caller may set, by their name there.
FLAGS = ("allow_requantize", "quantize_output_tensor", "pure")


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


def quantize_file(
    source: str, dest: str, file_type: int, threads: int, flags: dict[str, bool]
) -> None:
    """Write ``source``'s model quantized to ``file_type`` at ``dest``; RuntimeError with
    llama.cpp's reason when it refuses."""
    ensure_initialised()  # ggml's backends, and llama.cpp's log lines read for the reason
    params = ffi.new("llama_model_quantize_params *", call("llama_model_quantize_default_params"))
    params.ftype = file_type
    params.nthread = threads
    for name in FLAGS:
        setattr(params, name, flags[name])
    status = call("llama_model_quantize", c_path(source, "source"), c_path(dest, "dest"), params)
    if status != 0:
        raise RuntimeError(log_lines.take_errors() or f"llama_model_quantize returned {status}")


def main(argv: list[str]) -> int:
    source, dest, file_type, threads, flags = argv
    try:
        quantize_file(source, dest, int(file_type), int(threads), json.loads(flags))
    except Exception as error:  # the parent reads the reason; a traceback would hide it
        print(f"\n{error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
