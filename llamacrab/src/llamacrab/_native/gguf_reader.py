"""Read a GGUF file's header (metadata and tensor table) and check it against the file.

Everything is bounds-checked before it is read, so a truncated or tampered file raises
InvalidModelError; the value readers (``uint``, ``per_layer``) read keys as llama.cpp's getters do.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llamacrab._exceptions import InvalidModelError, ModelLoadError
from llamacrab_sys import ffi, lib

# GGUF value types (gguf.h: enum gguf_type), with the struct format of each scalar one.
SCALARS = {
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
STRING, ARRAY = 8, 9
UINT32, INT32, FLOAT32, BOOL = 4, 5, 6, 7
_WALKED_PAST_END = 2**64 - 1  # SIZE_MAX from llamacrab_gguf_skip_strings
_MAX_DIMS = 4
_DEFAULT_ALIGNMENT = 32
_TENSOR_ALIGNMENT = 32  # ggml's TENSOR_ALIGNMENT (ggml-backend.cpp)
_VECTOR_TYPES = (lib.GGML_TYPE_F32, lib.GGML_TYPE_I8, lib.GGML_TYPE_I16, lib.GGML_TYPE_I32,
                 lib.GGML_TYPE_I64)  # fmt: skip
# llama.cpp's layer limit (src/llama-hparams.h).
LLAMA_MAX_LAYERS = 512
TOKENS, TOKEN_TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"
# An importance matrix's texts (imatrix.py reads them; quantized files record the first).
IMATRIX_DATASETS = "imatrix.datasets"
_MAX_VOCABULARY = 1 << 22  # decoded whole in Python: bounded (real vocabularies are < 1M)


@dataclass(frozen=True)
class StringTable:
    """A string array as raw bytes (llama.cpp compares tokens byte for byte): one copy of its
    region of the file and where each string starts in it, not one Python object per string
    (262k of them for Gemma 3 cost ~80 ms of every model load)."""

    region: bytes
    starts: np.ndarray  # uint64 offsets into region; a string ends 8 bytes before the next starts

    def __len__(self) -> int:
        return len(self.starts)

    def word(self, i: int) -> bytes:
        end = int(self.starts[i + 1]) - 8 if i + 1 < len(self.starts) else len(self.region)
        return self.region[int(self.starts[i]) : end]

    def kept(self, i: int) -> bytes:
        """String ``i`` as llama.cpp keeps a token: cut at a NUL (it reads C strings), an empty
        one renamed [EMPTY_<index>]."""
        return self.word(i).split(b"\0", 1)[0] or f"[EMPTY_{i}]".encode()

    def first_repeated(self) -> int | None:
        """The index of the first string kept equal to an earlier one (compared in C)."""
        index = lib.llamacrab_gguf_first_repeated_string(
            ffi.from_buffer("uint8_t[]", self.region), len(self.region),
            ffi.from_buffer("uint64_t[]", self.starts), len(self.starts),
        )  # fmt: skip
        if index == -2:
            raise MemoryError("no memory to compare the vocabulary's tokens")
        return None if index < 0 else int(index)


@dataclass(frozen=True)
class GgufArray:
    """A metadata array: its item type and length, and its values when they are needed: numeric
    arrays short enough to be per-layer hyperparameters and the token types (``values``), the
    tokens (``strings``). Other arrays keep only their length."""

    item_kind: int
    count: int
    values: tuple[Any, ...] | None = None
    strings: StringTable | None = None


class Reader:
    """Reads a GGUF file's bytes in order; ``fail`` makes the error that names the file."""

    def __init__(self, data: Any, path: Path) -> None:
        self.data, self.offset, self.path = data, 0, path
        self.types: dict[str, int] = {}  # GGUF value type of each metadata key
        self.failing = f"{path} is not a valid GGUF file"  # what a problem makes the file
        # Rows of a learned position table (BERT, GPT-2): a position past them reads outside
        # the table, a GGML_ASSERT in ggml_get_rows (an abort). None: positions are computed.
        self.position_rows: int | None = None
        # Outputs of the classification head's last layer: a rank-pooled row's width, which
        # llama.cpp takes to be the labels' count. None: no head (a row is a hidden state).
        self.classifier_rows: int | None = None

    def fail(self, problem: str) -> InvalidModelError:
        return InvalidModelError(f"{self.failing}: {problem}")

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

    def _skip_strings(self, count: int, starts: Any = ffi.NULL) -> None:
        # Vocabularies hold hundreds of thousands of strings: their lengths are walked in C,
        # which also notes where each one starts when ``starts`` has room for ``count``.
        end = lib.llamacrab_gguf_skip_strings(
            ffi.from_buffer("uint8_t[]", self.data), len(self.data), self.offset, count, starts
        )
        if end == _WALKED_PAST_END:
            raise self.fail("a string array runs past the end of the file")
        self.offset = end

    def _strings(self, count: int) -> StringTable:
        """``count`` strings; the walk in C checks first that they lie inside the file and
        finds where each starts."""
        first = self.offset
        starts = np.empty(count, dtype=np.uint64)
        if count:
            self._skip_strings(count, ffi.from_buffer("uint64_t[]", starts))
        return StringTable(bytes(self.data[first : self.offset]), starts - np.uint64(first))

    def value(self, kind: int, whole: bool = False) -> Any:
        """The next value; ``whole`` decodes an array of up to _MAX_VOCABULARY entries."""
        if kind in SCALARS:
            return self.unpack(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item_kind, count = self.unpack("I"), self.unpack("Q")
            if whole and count > _MAX_VOCABULARY:
                raise self.fail(
                    f"a vocabulary array of {count} entries (at most {_MAX_VOCABULARY})"
                )
            if item_kind in SCALARS:
                size = struct.calcsize(SCALARS[item_kind]) * count
                if self.offset + size > len(self.data):
                    raise self.fail(f"an array of {count} items runs past the end of the file")
                values = None
                if whole or count <= LLAMA_MAX_LAYERS:  # per-layer values
                    values = struct.unpack_from(
                        f"<{count}{SCALARS[item_kind]}", self.data, self.offset
                    )
                self.offset += size
                return GgufArray(item_kind, count, values)
            if item_kind != STRING:
                raise self.fail(f"unsupported array item type {item_kind}")
            if whole:
                return GgufArray(item_kind, count, strings=self._strings(count))
            self._skip_strings(count)
            return GgufArray(item_kind, count)
        raise self.fail(f"unknown metadata value type {kind}")


def _read_header(reader: Reader) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]]]:
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
        reader.types[key] = kind = reader.unpack("I")
        metadata[key] = reader.value(kind, whole=key in (TOKENS, TOKEN_TYPES, IMATRIX_DATASETS))
    tensors = []
    for _ in range(n_tensors):
        name, n_dims = reader.string(), reader.unpack("I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise reader.fail(f"tensor {name!r} has {n_dims} dimensions")
        dims = [reader.unpack("Q") for _ in range(n_dims)]
        tensors.append((name, dims, reader.unpack("I"), reader.unpack("Q")))
    return metadata, tensors


def _check_tensors(reader: Reader, metadata: dict[str, Any], tensors: list[Any]) -> None:
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
        if ggml_type not in _VECTOR_TYPES and sum(d > 1 for d in dims) <= 1:
            # A float vector (a norm, a bias, a scale; or a Mamba-2 ssm_a / ssm_d, 1 x heads)
            # meets F32 activations in element-wise ops, which ggml's CPU kernels have for F32
            # only: F16, BF16 or a quantized type aborts at the first decode (binary-ops.cpp
            # "unsupported types"). Converters store vectors as F32; integer vectors are
            # lookup tables (eagle3's d2t).
            raise reader.fail(f"tensor {name!r} is a vector of type {ggml_type}, not F32")
        size = lib.ggml_row_size(ggml_type, dims[0]) * math.prod(dims[1:])
        if offset % alignment or data_start + offset + size > len(reader.data):
            raise reader.fail(f"tensor {name!r} data lies outside the file (truncated?)")
    # llama.cpp maps the data in place from the first tensor on, and ggml asserts (an abort)
    # that this address is 32-byte aligned: a general.alignment below 32 can break that.
    first = min((offset for _, _, _, offset in tensors), default=0)
    if (data_start + first) % _TENSOR_ALIGNMENT:
        raise reader.fail(
            f"tensor data starts at byte {data_start + first}, not a multiple of "
            f"{_TENSOR_ALIGNMENT} (general.alignment {alignment})"
        )


def uint(metadata: dict[str, Any], key: str) -> int | None:
    """An integer value, or None when absent or not an integer (llama.cpp's type-strict getters
    reject those with an exception, so they need no check here)."""
    value = metadata.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def per_layer(reader: Reader, metadata: dict[str, Any], key: str, n_layer: int) -> list[int]:
    """The values llama.cpp's get_key_or_arr reads for each layer: a scalar repeated, or an array
    of exactly block_count uint32/int32/bool (an int32 read as a uint32). [] when absent."""
    value = metadata.get(key)
    if value is None:
        return []
    if isinstance(value, GgufArray):
        if value.item_kind not in (UINT32, INT32, BOOL):
            raise reader.fail(f"{key} must be a uint32 or an array of {n_layer} uint32")
        if value.count != n_layer or value.values is None:  # None: longer than any block_count
            raise reader.fail(f"{key} has {value.count} entries, block_count is {n_layer}")
        return [int(v) & 0xFFFFFFFF for v in value.values]
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * n_layer
    raise reader.fail(f"{key} = {value!r} must be a uint32 or an array of {n_layer} uint32")


_SPLIT_NAME = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def read_file(path: Path) -> tuple[Reader, dict[str, Any], list[Any]]:
    """Header of one file, with its own tensors checked against its size."""
    try:
        if not path.is_file():
            what = "is not a regular file" if path.exists() else "not found"
            raise ModelLoadError(f"model file {what}: {path}")
        size = path.stat().st_size
        if size < 24:
            raise InvalidModelError(f"{path} is not a valid GGUF file: only {size} bytes")
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            reader = Reader(data, path)
            metadata, tensors = _read_header(reader)
            _check_tensors(reader, metadata, tensors)
            reader.data = b""  # the mapping closes here; later checks use the parsed header only
    except OSError as error:  # a name too long, no permission: is_file() lets those through
        raise ModelLoadError(f"cannot read {path}: {error.strerror or error}") from None
    return reader, metadata, tensors


def read_gguf_tensors(path: Path) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]]]:
    """The metadata and tensors of one file, its header checked: each tensor's name,
    dimensions, GGML type and the absolute file offset of its data (within the file)."""
    reader, metadata, tensors = read_file(path)
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = -(-reader.offset // alignment) * alignment
    return metadata, [(name, dims, kind, data_start + at) for name, dims, kind, at in tensors]


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
