"""``quantize``: a GGUF model written again with its weights quantized (llama-quantize's job),
by llama.cpp in a child process (``_native.quantize`` says why), into a temporary file beside
the destination that replaces it only once whole."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path

from llamacrab._exceptions import InvalidParameterError, QuantizationError
from llamacrab._field_types import INT32_MAX, check_range, file_path
from llamacrab._native.gguf.check import validate_gguf
from llamacrab._native.gguf_reader import split_parts
from llamacrab._native.host_limits import default_threads
from llamacrab._native.imatrix import read_imatrix
from llamacrab._native.quantize import FLAGS, file_types
from llamacrab._native.quantize import tensor_types as weight_types

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
    output_tensor_type: str | None = None,
    token_embedding_type: str | None = None,
    tensor_types: Mapping[str, str] | None = None,
    imatrix: str | os.PathLike[str] | None = None,
    keep_split: bool = False,
) -> Path:
    """Write the model at ``source`` (a GGUF file) to ``dest`` with its weights quantized to
    ``file_type`` (a name of ``quantize_types()``: Q4_K_M, Q8_0, F16, ...), as llama-quantize
    does: tensors whose rows a type cannot divide fall back to another type, and the token
    embeddings and output layer get llama.cpp's usual choices. ``allow_requantize`` lets an
    already quantized model be quantized again (at a loss); ``quantize_output_tensor=False``
    keeps the output layer as it is; ``pure`` gives every tensor ``file_type``.
    ``output_tensor_type``, ``token_embedding_type`` and ``tensor_types`` (a regex searched in
    each tensor's name: a ggml type, ``{"attn_v": "q8_0"}``; the first that matches wins) name
    ggml tensor types (q8_0, f16, q4_K, ...: ``quantize_types(tensors=True)``). ``imatrix``
    is an importance matrix file (llama-imatrix's, GGUF or legacy ``.dat``): the types that
    use one weigh each column's error by it, and the types that need one (IQ1/IQ2 and a few
    others) are refused by llama.cpp without it; the file's name, dataset and counts are
    recorded in the output's metadata, as llama-quantize records them. ``keep_split`` writes
    a split model (``source`` its first part) as as many parts, ``dest`` less its ``.gguf``
    then ``-00001-of-0000N.gguf`` and so on (llama-quantize's ``--keep-split``), and returns
    the first; otherwise returns ``dest``, one file.
    QuantizationError with llama.cpp's reason when it refuses (``dest`` untouched); Ctrl-C
    stops the work at once."""
    source_path, dest_path = file_path("source", source), file_path("dest", dest)
    types = file_types()
    chosen = types.get(file_type.upper()) if isinstance(file_type, str) else None
    if chosen is None:
        raise InvalidParameterError(
            f"file_type must be one of {', '.join(types)}, not {file_type!r}"
        )
    check_range("threads", threads, 1, INT32_MAX)
    options: dict[str, object] = {"file_type": chosen, "allow_requantize": allow_requantize,
                                  "quantize_output_tensor": quantize_output_tensor,
                                  "pure": pure, "keep_split": keep_split}  # fmt: skip
    for name in FLAGS:
        if not isinstance(options[name], bool):
            raise InvalidParameterError(f"{name} must be True or False, not {options[name]!r}")
    options["output_tensor_type"] = _tensor_type("output_tensor_type", output_tensor_type)
    options["token_embedding_type"] = _tensor_type("token_embedding_type", token_embedding_type)
    options["tensor_types"] = _overrides(tensor_types)
    _, metadata = validate_gguf(source_path)  # what llama.cpp's loader would trip on, named here
    if imatrix is not None:
        imatrix_path = file_path("imatrix", imatrix)
        read_imatrix(imatrix_path)  # its problems named here, not by the child
        options["imatrix"] = os.fspath(imatrix)
    else:
        options["imatrix"] = None
    count = metadata.get("split.count", 1)
    parts = split_parts(source_path, count) if isinstance(count, int) and count > 1 else []
    # Named uniquely (not by pid): two threads writing the same dest must not share it. Not
    # made here (mkstemp's would be 0600): llama.cpp creates it with the umask's permissions.
    partial = dest_path.with_name(f".{dest_path.name}.{uuid.uuid4().hex}.partial")
    if keep_split:  # llama.cpp names the parts after a prefix, as llama_split_path does
        n = max(len(parts), 1)
        outputs = _split_names(dest_path.with_name(dest_path.name.removesuffix(".gguf")), n)
        made = _split_names(partial, n)
    else:
        outputs, made = [dest_path], [partial]
    if not dest_path.parent.is_dir():
        raise InvalidParameterError(f"dest's folder does not exist: {dest_path.parent}")
    for output in outputs:
        if output.is_dir():
            raise InvalidParameterError(f"dest is a folder, not a file: {output}")
        if output.exists() and any(output.samefile(p) for p in (source_path, *parts)):
            raise InvalidParameterError(f"dest would replace the source itself: {output}")
    options["threads"] = threads or default_threads().amount
    try:
        _run(source_path, partial, options)
        for written, output in zip(made, outputs, strict=True):
            os.replace(written, output)
    finally:
        for written in made:
            written.unlink(missing_ok=True)
    return outputs[0]


def _split_names(prefix: Path, count: int) -> list[Path]:
    """llama_split_path's names of ``count`` parts."""
    return [prefix.with_name(f"{prefix.name}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]  # fmt: skip


def quantize_types(tensors: bool = False) -> list[str]:
    """The names ``quantize`` takes as ``file_type`` (Q4_K_M, ...), or with ``tensors`` as a
    tensor's type (q8_0, ...)."""
    return list(weight_types() if tensors else file_types())


def _tensor_type(what: str, name: object) -> int | None:
    if name is None:
        return None
    types = weight_types()
    by_lower = {known.lower(): index for known, index in types.items()}  # q4_k as q4_K
    found = by_lower.get(name.lower()) if isinstance(name, str) else None
    if found is None:
        raise InvalidParameterError(f"{what} must be one of {', '.join(types)}, not {name!r}")
    return found


def _overrides(overrides: Mapping[str, str] | None) -> list[tuple[str, int]]:
    """``tensor_types`` as (regex, type) pairs, checked: llama.cpp compiles them with
    std::regex, whose syntax Python's mostly shares."""
    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise InvalidParameterError(f"tensor_types must be a mapping, not {overrides!r}")
    pairs = []
    for pattern, name in overrides.items():
        if not isinstance(pattern, str) or not pattern or "\0" in pattern:
            raise InvalidParameterError(f"a tensor_types pattern must be text, not {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as error:
            raise InvalidParameterError(f"tensor_types pattern {pattern!r}: {error}") from None
        type_id = _tensor_type(f"tensor_types[{pattern!r}]", name)
        if type_id is None:
            raise InvalidParameterError(f"tensor_types[{pattern!r}] must name a type, not None")
        pairs.append((pattern, type_id))
    return pairs


def _run(source: Path, dest: Path, options: dict[str, object]) -> None:
    argv = [sys.executable, "-m", CHILD_MODULE, os.fspath(source), os.fspath(dest),
            json.dumps(options)]  # fmt: skip
    # The child imports this llamacrab, wherever it was imported from (a sys.path entry added
    # at run time, say, which the child would not have).
    here = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path}
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          env=environment) as child:  # fmt: skip
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
