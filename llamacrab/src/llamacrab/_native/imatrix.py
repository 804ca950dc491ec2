"""Importance matrices (llama-imatrix's output) as llama_model_quantize takes them: for each
weight, by tensor name, the mean squared activation of each input column (per expert),
normalized as llama-quantize does. Read from the GGUF imatrix format or the legacy ``.dat``,
every length checked against the file before it is trusted."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llamacrab._exceptions import InvalidModelError, InvalidParameterError
from llamacrab._native.gguf_reader import IMATRIX_DATASETS, read_gguf_tensors

_SUMS, _COUNTS = ".in_sum2", ".counts"
_METADATA = (IMATRIX_DATASETS, "imatrix.chunk_count", "imatrix.chunk_size")
_F32 = 0  # GGML_TYPE_F32


@dataclass(frozen=True)
class Imatrix:
    """What llama-quantize takes from an imatrix file."""

    entries: dict[str, np.ndarray]  # tensor name -> float32 importances
    datasets: tuple[str, ...]  # the texts it was computed on, as recorded
    chunk_count: int  # how many chunks of them (0: not recorded)


def read_imatrix(path: Path) -> Imatrix:
    """The importance matrix in ``path``; InvalidParameterError naming what is wrong with it
    (llama-quantize exits, or its library throws, on the same files)."""
    try:
        if not path.is_file():  # a FIFO would block, /dev/zero would never end
            what = "is not a regular file" if path.exists() else "does not exist"
            raise InvalidParameterError(f"imatrix {path} {what}")
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as error:
        raise InvalidParameterError(f"cannot read imatrix {path}: {error.strerror}") from None
    entries, datasets, chunks = _read_gguf(path) if magic == b"GGUF" else _read_legacy(path)
    if not entries:
        raise InvalidParameterError(f"imatrix {path} holds no entries")
    for name, values in entries.items():
        if not np.isfinite(values).all():
            raise InvalidParameterError(f"imatrix {path}: {name} has a non-finite value")
    return Imatrix(entries, datasets, chunks)


def _read_gguf(path: Path) -> tuple[dict[str, np.ndarray], tuple[str, ...], int]:
    try:
        metadata, tensors = read_gguf_tensors(path)
    except InvalidModelError as error:
        raise InvalidParameterError(f"imatrix: {error}") from None
    missing = [key for key in _METADATA if key not in metadata]
    if missing:  # llama-quantize refuses such a file too
        raise InvalidParameterError(f"imatrix {path} lacks its metadata: {', '.join(missing)}")
    # Only an array of strings is read, as llama-quantize reads it; as C strings (to a NUL).
    strings = getattr(metadata[IMATRIX_DATASETS], "strings", None)
    datasets: tuple[str, ...] = ()
    if strings is not None:
        datasets = tuple(_c_string(strings.word(i)) for i in range(len(strings)))
    chunk_count = metadata["imatrix.chunk_count"]
    if isinstance(chunk_count, bool) or not isinstance(chunk_count, int) or chunk_count >= 2**32:
        raise InvalidParameterError(
            f"imatrix {path}: imatrix.chunk_count is {chunk_count!r}, not a uint32"
        )
    parts: dict[str, dict[str, np.ndarray]] = {}
    with path.open("rb") as file:
        for name, dims, ggml_type, offset in tensors:
            for suffix in (_SUMS, _COUNTS):
                if name.endswith(suffix) and len(name) > len(suffix):
                    if ggml_type != _F32:
                        raise InvalidParameterError(f"imatrix {path}: {name} is not F32")
                    file.seek(offset)
                    values = np.fromfile(file, dtype="<f4", count=math.prod(dims))
                    parts.setdefault(name.removesuffix(suffix), {})[suffix] = values
    entries = {}
    for name, found in parts.items():
        if len(found) != 2:
            raise InvalidParameterError(f"imatrix {path}: {name} has sums or counts, not both")
        entries[name] = _per_count(path, name, found[_SUMS], found[_COUNTS])
    return entries, datasets, chunk_count


def _per_count(path: Path, name: str, sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each expert's sums over the number of tokens it saw (1 where it saw none)."""
    if sums.size % counts.size:
        raise InvalidParameterError(
            f"imatrix {path}: {name} has {sums.size} sums for {counts.size} counts"
        )
    # std::lround: halves away from zero
    whole = np.where(counts >= 0, np.floor(counts + 0.5), np.ceil(counts - 0.5))
    per_expert = sums.astype(np.float32).reshape(counts.size, -1)
    seen = whole.astype(np.float32)[:, np.newaxis]
    with np.errstate(divide="ignore", invalid="ignore"):
        values = np.where(seen > 0, per_expert / seen, np.float32(1))
    return values.astype(np.float32).reshape(-1)


def _read_legacy(path: Path) -> tuple[dict[str, np.ndarray], tuple[str, ...], int]:
    """llama-imatrix's first format: entries of (name, calls, values), then optionally the
    chunk count and the dataset's name."""
    data = path.read_bytes()
    at = 0

    def take(size: int, what: str) -> bytes:
        nonlocal at
        if size < 0 or at + size > len(data):
            raise InvalidParameterError(f"imatrix {path} is truncated in {what}")
        at += size
        return data[at - size : at]

    def int32(what: str) -> int:
        value: int = struct.unpack("<i", take(4, what))[0]
        return value

    n_entries = int32("its entry count")
    if n_entries < 1:
        raise InvalidParameterError(f"imatrix {path} is neither GGUF nor a legacy imatrix")
    entries = {}
    for index in range(n_entries):
        name = _c_string(take(int32(f"entry {index}"), f"entry {index}'s name"))
        calls, n_values = int32(f"entry {index}"), int32(f"entry {index}")
        if n_values < 1:
            raise InvalidParameterError(f"imatrix {path}: entry {index} has {n_values} values")
        sums = np.frombuffer(take(4 * n_values, f"{name}'s values"), dtype="<f4")
        values = sums / np.float32(calls) if calls > 0 else sums  # sums of per-call means
        entries[name] = values.astype(np.float32)
    chunks, datasets = 0, tuple[str, ...]()
    if len(data) - at >= 4:
        chunks = int32("its chunk count")
        if len(data) - at >= 4:
            length = int32("its dataset name")
            if 0 < length <= len(data) - at:
                datasets = (_c_string(take(length, "its dataset name")),)
    return entries, datasets, chunks


def _c_string(raw: bytes) -> str:
    """Text llama.cpp reads as a C string: up to its first NUL."""
    return raw.split(b"\0")[0].decode("utf-8", "replace")
