"""``quantize``: a GGUF model written again with its weights quantized (llama-quantize's job),
by llama.cpp in a child process (``_native.quantize`` says why), into a temporary file beside
the destination that replaces it only once whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from llamacrab._exceptions import InvalidParameterError, QuantizationError
from llamacrab._field_types import INT32_MAX, check_range, file_path
from llamacrab._native.gguf.check import validate_gguf
from llamacrab._native.host_limits import default_threads
from llamacrab._native.quantize import file_types

# The module the child runs (a test puts one that dies in its place).
CHILD_MODULE = "llamacrab._native.quantize"


def quantize(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    file_type: str = "Q4_K_M",
    *,
    threads: int | None = None,
    allow_requantize: bool = False,
    quantize_output_tensor: bool = True,
    pure: bool = False,
) -> Path:
    """Write the model at ``source`` (a GGUF file) to ``dest`` with its weights quantized to
    ``file_type`` (a name of ``quantize_types()``: Q4_K_M, Q8_0, F16, ...), as llama-quantize
    does: tensors whose rows a type cannot divide fall back to another type, and the token
    embeddings and output layer get llama.cpp's usual choices. ``allow_requantize`` lets an
    already quantized model be quantized again (at a loss); ``quantize_output_tensor=False``
    keeps the output layer as it is; ``pure`` gives every tensor ``file_type``. Types that
    need an importance matrix (IQ1/IQ2 and a few others) are refused by llama.cpp without one,
    which this API does not take yet. Returns ``dest``. QuantizationError with llama.cpp's
    reason when it refuses (``dest`` untouched); Ctrl-C stops the work at once."""
    source_path, dest_path = file_path("source", source), file_path("dest", dest)
    types = file_types()
    chosen = types.get(file_type.upper()) if isinstance(file_type, str) else None
    if chosen is None:
        raise InvalidParameterError(
            f"file_type must be one of {', '.join(types)}, not {file_type!r}"
        )
    check_range("threads", threads, 1, INT32_MAX)
    flags = {"allow_requantize": allow_requantize,
             "quantize_output_tensor": quantize_output_tensor, "pure": pure}  # fmt: skip
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidParameterError(f"{name} must be True or False, not {value!r}")
    validate_gguf(source_path)  # what llama.cpp's loader would trip on, named here
    if dest_path.exists() and dest_path.samefile(source_path):
        raise InvalidParameterError(f"dest is the source itself: {dest_path}")
    if not dest_path.parent.is_dir():
        raise InvalidParameterError(f"dest's folder does not exist: {dest_path.parent}")
    partial = dest_path.with_name(f".{dest_path.name}.{os.getpid()}.partial")
    count = threads or default_threads().amount
    try:
        _run(source_path, partial, chosen, count, flags)
        os.replace(partial, dest_path)
    finally:
        partial.unlink(missing_ok=True)
    return dest_path


def quantize_types() -> list[str]:
    """The names ``quantize`` takes as ``file_type``."""
    return list(file_types())


def _run(source: Path, dest: Path, file_type: int, threads: int, flags: dict[str, bool]) -> None:
    argv = [sys.executable, "-m", CHILD_MODULE, os.fspath(source),
            os.fspath(dest), str(file_type), str(threads), json.dumps(flags)]  # fmt: skip
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as child:
        try:
            errors = _wait(child)
        except BaseException:  # Ctrl-C, say: llama.cpp's loop cannot be asked to stop
            child.kill()
            child.wait()  # reaped now: on a Ctrl-C, Popen's exit would leave it a zombie
            raise
    if child.returncode == 0:
        return
    lines = errors.decode(errors="replace").strip().splitlines()
    reason = lines[-1] if lines else "no reason given"
    if child.returncode < 0:
        reason = f"llama.cpp's process ended on signal {-child.returncode} ({reason})"
    raise QuantizationError(f"could not quantize {source.name}: {reason}")


def _wait(child: subprocess.Popen[bytes]) -> bytes:
    """The child's stderr once it ended, waiting in short steps: a blocking read would see a
    Ctrl-C (or any exception raised in this thread) only once the child ended."""
    while True:
        try:
            return child.communicate(timeout=0.25)[1]
        except subprocess.TimeoutExpired:
            continue
