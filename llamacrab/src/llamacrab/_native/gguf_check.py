"""Validate a GGUF file's header before llama.cpp sees it.

llama.cpp rejects most malformed files cleanly, but some tampered values reach a GGML_ASSERT and
abort the whole process (a block_count that disagrees with the blk.N tensors, a non-positive norm
epsilon, ...). Everything that can be checked from the header is checked here, so such files raise
InvalidModelError instead.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from pathlib import Path
from typing import Any

from llamacrab._exceptions import InvalidModelError, ModelLoadError
from llamacrab_sys import ffi, lib

_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_WALKED_PAST_END = 2**64 - 1  # SIZE_MAX from llamacrab_gguf_skip_strings
_MAX_DIMS = 4
_DEFAULT_ALIGNMENT = 32


class _Reader:
    def __init__(self, data: Any, path: Path) -> None:
        self.data, self.offset, self.path = data, 0, path

    def fail(self, problem: str) -> InvalidModelError:
        return InvalidModelError(f"{self.path} is not a valid GGUF file: {problem}")

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.offset + size > len(self.data):
            raise self.fail(f"truncated at byte {self.offset}")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        if self.offset + length > len(self.data):
            raise self.fail(f"a string of {length} bytes runs past the end of the file")
        raw = bytes(self.data[self.offset : self.offset + length])
        self.offset += length
        return raw.decode("utf-8", "replace")

    def _skip_strings(self, count: int) -> None:
        # Vocabularies hold hundreds of thousands of strings: their lengths are walked in C.
        end = lib.llamacrab_gguf_skip_strings(
            ffi.from_buffer("uint8_t[]", self.data), len(self.data), self.offset, count
        )
        if end == _WALKED_PAST_END:
            raise self.fail("a string array runs past the end of the file")
        self.offset = end

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("I"), self.unpack("Q")
            if item_kind in _SCALARS:
                size = struct.calcsize(_SCALARS[item_kind]) * count
                if self.offset + size > len(self.data):
                    raise self.fail(f"an array of {count} items runs past the end of the file")
                self.offset += size  # arrays of numbers are not needed for validation
                return count
            if item_kind != _STRING:
                raise self.fail(f"unsupported array item type {item_kind}")
            self._skip_strings(count)
            return count
        raise self.fail(f"unknown metadata value type {kind}")


def _read_header(reader: _Reader) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]]]:
    if reader.unpack("4s") != b"GGUF":
        raise reader.fail("it does not start with the GGUF magic")
    version = reader.unpack("I")
    if version not in (2, 3):
        raise reader.fail(f"unsupported GGUF version {version}")
    n_tensors, n_kv = reader.unpack("Q"), reader.unpack("Q")
    # Every entry needs at least a few bytes: counts beyond that are tampering, not models.
    if n_kv * 12 > len(reader.data) or n_tensors * 24 > len(reader.data):
        raise reader.fail(f"{n_kv} metadata entries / {n_tensors} tensors cannot fit in the file")
    metadata = {}
    for _ in range(n_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.unpack("I"))
    tensors = []
    for _ in range(n_tensors):
        name, n_dims = reader.string(), reader.unpack("I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise reader.fail(f"tensor {name!r} has {n_dims} dimensions")
        dims = [reader.unpack("Q") for _ in range(n_dims)]
        tensors.append((name, dims, reader.unpack("I"), reader.unpack("Q")))
    return metadata, tensors


def _check_tensors(reader: _Reader, metadata: dict[str, Any], tensors: list[Any]) -> None:
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise reader.fail(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-reader.offset // alignment) * alignment
    for name, dims, ggml_type, offset in tensors:
        if ggml_type >= lib.GGML_TYPE_COUNT or lib.ggml_blck_size(ggml_type) <= 0:
            raise reader.fail(f"tensor {name!r} has unknown type {ggml_type}")
        if any(d <= 0 or d >= 1 << 40 for d in dims):
            raise reader.fail(f"tensor {name!r} has dimensions {dims}")
        if dims[0] % lib.ggml_blck_size(ggml_type):
            raise reader.fail(f"tensor {name!r} row of {dims[0]} is not whole blocks")
        size = lib.ggml_row_size(ggml_type, dims[0]) * math.prod(dims[1:])
        if offset % alignment or data_start + offset + size > len(reader.data):
            raise reader.fail(f"tensor {name!r} data lies outside the file (truncated?)")


def _check_hyperparameters(reader: _Reader, metadata: dict[str, Any], tensors: list[Any]) -> None:
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise reader.fail("general.architecture is missing")
    if metadata.get("general.type", "model") != "model":
        return  # adapters and projectors are checked by the code that loads them
    for key, value in metadata.items():
        if not key.startswith(arch + "."):
            continue
        minimum = 1 if key.endswith("block_count") else 0
        counted = key.endswith(("_length", "_count", "count_kv"))
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if counted and number and value < minimum:
            raise reader.fail(f"{key} = {value} is out of range")
        if "epsilon" in key and isinstance(value, float) and not value > 0:
            raise reader.fail(f"{key} = {value} must be positive")
    blocks = {int(m.group(1)) for t in tensors if (m := re.match(r"blk\.(\d+)\.", t[0]))}
    block_count = metadata.get(f"{arch}.block_count")
    if blocks and isinstance(block_count, int) and max(blocks) + 1 != block_count:
        raise reader.fail(
            f"{arch}.block_count = {block_count} but the tensors describe {max(blocks) + 1} blocks"
        )
    n_embd = metadata.get(f"{arch}.embedding_length")
    embeddings = [t for t in tensors if t[0] == "token_embd.weight"]
    if embeddings and isinstance(n_embd, int) and embeddings[0][1][0] != n_embd:
        raise reader.fail(
            f"token_embd.weight has rows of {embeddings[0][1][0]}, "
            f"{arch}.embedding_length is {n_embd}"
        )


_SPLIT_NAME = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def _read_file(path: Path) -> tuple[_Reader, dict[str, Any], list[Any]]:
    """Header of one file, with its own tensors checked against its size."""
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    size = path.stat().st_size
    if size < 24:
        raise InvalidModelError(f"{path} is not a valid GGUF file: only {size} bytes")
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        reader = _Reader(data, path)
        metadata, tensors = _read_header(reader)
        _check_tensors(reader, metadata, tensors)
        reader.data = b""  # the mapping closes here; later checks use the parsed header only
    return reader, metadata, tensors


def split_parts(path: Path, count: int) -> list[Path]:
    """Every file of a split model, from its first part ``name-00001-of-0000N.gguf``."""
    match = _SPLIT_NAME.match(path.name)
    if match is None or int(match.group(2)) != 1 or int(match.group(3)) != count:
        raise InvalidModelError(
            f"{path} declares {count} split parts but is not named like name-00001-of-"
            f"{count:05d}.gguf"
        )
    return [
        path.with_name(f"{match.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    ]


def validate_gguf(path: Path) -> None:
    """Raise ModelLoadError / InvalidModelError unless ``path`` looks safe to hand to llama.cpp.
    For a split model, ``path`` is the first part and every part is checked."""
    reader, metadata, tensors = _read_file(path)
    count = metadata.get("split.count", 1)
    if isinstance(count, int) and count > 1:
        for part in split_parts(path, count)[1:]:
            tensors = tensors + _read_file(part)[2]
    _check_hyperparameters(reader, metadata, tensors)
