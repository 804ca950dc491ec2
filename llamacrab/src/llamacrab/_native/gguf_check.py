"""Validate a GGUF file's header before llama.cpp sees it.

llama.cpp rejects most malformed files cleanly, but some tampered values reach a GGML_ASSERT and
abort the whole process (a block_count that disagrees with the blk.N tensors, a non-positive norm
epsilon, ...). Everything that can be checked from the header is checked here, so such files raise
InvalidModelError instead. docs/native-aborts.md lists the asserts and which check covers each.
"""

from __future__ import annotations

import copy
import math
import mmap
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np

from llamacrab._exceptions import InvalidModelError, InvalidParameterError, ModelLoadError
from llamacrab._native import gguf_archs as archs
from llamacrab._native import gguf_plamo2 as plamo2
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
_UINT32, _INT32, _FLOAT32, _BOOL = 4, 5, 6, 7
_WALKED_PAST_END = 2**64 - 1  # SIZE_MAX from llamacrab_gguf_skip_strings
_MAX_DIMS = 4
_DEFAULT_ALIGNMENT = 32
_TENSOR_ALIGNMENT = 32  # ggml's TENSOR_ALIGNMENT (ggml-backend.cpp)
_VECTOR_TYPES = (lib.GGML_TYPE_F32, lib.GGML_TYPE_I8, lib.GGML_TYPE_I16, lib.GGML_TYPE_I32,
                 lib.GGML_TYPE_I64)  # fmt: skip
# llama.cpp limits (src/llama-hparams.h) and enums (include/llama.h, src/llama-hparams.h).
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
_TOKENS, _TOKEN_TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"
_MAX_VOCABULARY = 1 << 22  # decoded whole in Python: bounded (real vocabularies are < 1M)
_NORMAL_TOKEN, _USER_DEFINED_TOKEN, _UNUSED_TOKEN, _BYTE_TOKEN = 1, 4, 5, 6  # LLAMA_TOKEN_TYPE_*
# llama.cpp's naive_trie (src/llama-vocab.cpp) inserts a token, frees it and matches it (UGM's
# user-defined tokens) one nested call per byte: ~180 bytes of stack a byte (x86-64 Release
# build: a 256 KiB thread died loading a 1,455-byte token, a 1 MiB one at 5,971, the 8 MiB main
# thread near 45,000, a SIGSEGV). 512 bytes take ~90 KiB, within musl's 128 KiB default thread
# stack; the longest tokens of real trie vocabularies are 128 bytes (RWKV World) and 48 (XLM-R's
# t5 vocabulary). BPE vocabularies, which hold tokens of 1,024 bytes (GPT-NeoX), build no trie.
MAX_TRIE_TOKEN_BYTES = 512
# The tokenizers that build such a trie, and the token types they put in it (None: every token).
_TRIE_TOKEN_TYPES = {"rwkv": None, "t5": (_NORMAL_TOKEN, _USER_DEFINED_TOKEN, _UNUSED_TOKEN)}
# The tokenizers whose token_to_byte reads a byte token's value from its text, as substr(3, 2)
# (SPM, UGM and BPE): a text shorter than 3 bytes throws at load, another one gives a wrong byte.
_SPELT_BYTE_MODELS = ("llama", "t5", "gpt2", "hybriddna", "whitespace", "gemma4")
_BYTE_SPELLING = re.compile(rb"<0x[0-9A-Fa-f]{2}>")
_UGM_LOAD_UNKNOWN = 2  # the unknown token t5's load tokenizes with before reading the file's
_POOLING_TYPES = range(5)  # none, mean, cls, last, rank
_EXPERT_GATING_FUNCS = range(1, 5)  # softmax, sigmoid, softmax_weight, sqrt_softplus
# These archs reset expert_count <= 1 to 0 (and expert_used_count to 0) before the expert asserts.
_EXPERTS_RESET_ARCHS = ("hunyuan-dense", "hunyuan_vl")

Kind = Literal["model", "adapter", "projector"]


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


class _Reader:
    def __init__(self, data: Any, path: Path) -> None:
        self.data, self.offset, self.path = data, 0, path
        self.types: dict[str, int] = {}  # GGUF value type of each metadata key
        self.failing = f"{path} is not a valid GGUF file"  # what a problem makes the file
        # Rows of a learned position table (BERT, GPT-2): a position past them reads outside
        # the table, a GGML_ASSERT in ggml_get_rows (an abort). None: positions are computed.
        self.position_rows: int | None = None

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
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("I"), self.unpack("Q")
            if whole and count > _MAX_VOCABULARY:
                raise self.fail(
                    f"a vocabulary array of {count} entries (at most {_MAX_VOCABULARY})"
                )
            if item_kind in _SCALARS:
                size = struct.calcsize(_SCALARS[item_kind]) * count
                if self.offset + size > len(self.data):
                    raise self.fail(f"an array of {count} items runs past the end of the file")
                values = None
                if whole or count <= LLAMA_MAX_LAYERS:  # per-layer values
                    values = struct.unpack_from(
                        f"<{count}{_SCALARS[item_kind]}", self.data, self.offset
                    )
                self.offset += size
                return GgufArray(item_kind, count, values)
            if item_kind != _STRING:
                raise self.fail(f"unsupported array item type {item_kind}")
            if whole:
                return GgufArray(item_kind, count, strings=self._strings(count))
            self._skip_strings(count)
            return GgufArray(item_kind, count)
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
        reader.types[key] = kind = reader.unpack("I")
        metadata[key] = reader.value(kind, whole=key in (_TOKENS, _TOKEN_TYPES))
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
        if ggml_type not in _VECTOR_TYPES and math.prod(dims[1:]) == 1:
            # A float vector (a norm, a bias, a scale) meets F32 activations in element-wise
            # ops, which ggml's CPU kernels have for F32 only: F16, BF16 or a quantized type
            # aborts at the first decode (binary-ops.cpp "unsupported types"). Converters store
            # vectors as F32; integer vectors are lookup tables (eagle3's d2t).
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


def _uint(metadata: dict[str, Any], key: str) -> int | None:
    """An integer value, or None when absent or not an integer (llama.cpp's type-strict getters
    reject those with an exception, so they need no check here)."""
    value = metadata.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _per_layer(reader: _Reader, metadata: dict[str, Any], key: str, n_layer: int) -> list[int]:
    """The values llama.cpp's get_key_or_arr reads for each layer: a scalar repeated, or an array
    of exactly block_count uint32/int32/bool (an int32 read as a uint32). [] when absent."""
    value = metadata.get(key)
    if value is None:
        return []
    if isinstance(value, GgufArray):
        if value.item_kind not in (_UINT32, _INT32, _BOOL):
            raise reader.fail(f"{key} must be a uint32 or an array of {n_layer} uint32")
        if value.count != n_layer or value.values is None:  # None: longer than any block_count
            raise reader.fail(f"{key} has {value.count} entries, block_count is {n_layer}")
        return [int(v) & 0xFFFFFFFF for v in value.values]
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * n_layer
    raise reader.fail(f"{key} = {value!r} must be a uint32 or an array of {n_layer} uint32")


def _check_header_types(reader: _Reader, metadata: dict[str, Any]) -> None:
    """Keys that llama_adapter_lora_init reads with gguf_get_val_str / _f32, which assert the
    type (an abort) instead of checking it. Adapters and models alike: the GGUF spec types them."""
    for key in ("general.type", "adapter.type"):
        if key in metadata and not isinstance(metadata[key], str):
            raise reader.fail(f"{key} = {metadata[key]!r} must be a string")
    alpha = "adapter.lora.alpha"
    if alpha in metadata and reader.types[alpha] != _FLOAT32:
        raise reader.fail(f"{alpha} = {metadata[alpha]!r} must be a float32")


def _check_generic(reader: _Reader, arch: str, metadata: dict[str, Any]) -> None:
    for key, value in metadata.items():
        if not key.startswith(arch + "."):
            continue
        minimum = 1 if key == f"{arch}.block_count" else 0  # leading_dense_block_count may be 0
        counted = key.endswith(("_length", "_count", "count_kv"))
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if counted and number and value < minimum:
            raise reader.fail(f"{key} = {value} is out of range (minimum {minimum})")
        if "epsilon" in key and isinstance(value, float) and not value > 0:
            raise reader.fail(f"{key} = {value} must be positive")


def _check_layers(
    reader: _Reader, arch: str, metadata: dict[str, Any], tensors: list[Any]
) -> int | None:
    """block_count (None when absent: llama.cpp then refuses the file) and the counts bounded
    by it (llama-model.cpp: n_layer_all, n_layer_nextn, wavtokenizer posnet/convnext)."""
    key = f"{arch}.block_count"
    block_count = _uint(metadata, key)
    if block_count is None:
        return None
    if not 1 <= block_count <= LLAMA_MAX_LAYERS:
        raise reader.fail(f"{key} = {block_count} is out of range 1..{LLAMA_MAX_LAYERS}")
    blocks = {int(m.group(1)) for t in tensors if (m := re.match(r"blk\.(\d+)\.", t[0]))}
    if blocks and max(blocks) + 1 != block_count:
        raise reader.fail(
            f"{key} = {block_count} but the tensors describe {max(blocks) + 1} blocks"
        )
    bounded = ["nextn_predict_layers"]
    if arch == "wavtokenizer-dec":
        bounded += ["posnet.block_count", "convnext.block_count"]
    for name in bounded:
        value = _uint(metadata, f"{arch}.{name}")
        if value is not None and value > block_count:
            raise reader.fail(f"{arch}.{name} = {value} exceeds {key} = {block_count}")
    return block_count


def _check_experts(reader: _Reader, arch: str, metadata: dict[str, Any], n_layer: int) -> None:
    """The expert asserts of llama-model.cpp (load_hparams, after the expert keys are read)."""
    count_key, used_key = f"{arch}.expert_count", f"{arch}.expert_used_count"
    groups_key, group_used_key = f"{arch}.expert_group_count", f"{arch}.expert_group_used_count"
    n_expert = _uint(metadata, count_key) or 0
    used_max = max(_per_layer(reader, metadata, used_key, n_layer), default=0)
    groups = _uint(metadata, groups_key) or 0
    group_used = _uint(metadata, group_used_key) or 0
    if arch in _EXPERTS_RESET_ARCHS and n_expert <= 1:
        n_expert = used_max = 0
    if n_expert > LLAMA_MAX_EXPERTS:
        raise reader.fail(f"{count_key} = {n_expert} exceeds {LLAMA_MAX_EXPERTS}")
    if used_max > n_expert:
        raise reader.fail(f"{used_key} = {used_max} exceeds {count_key} = {n_expert}")
    if n_expert == 0:
        if groups:
            raise reader.fail(f"{groups_key} = {groups} needs {count_key} > 0")
        return
    if used_max == 0:
        raise reader.fail(f"{count_key} = {n_expert} needs {used_key} > 0")
    if groups >= n_expert:
        raise reader.fail(f"{groups_key} = {groups} must be below {count_key} = {n_expert}")
    if groups > 1:
        if n_expert % groups:
            raise reader.fail(
                f"{count_key} = {n_expert} is not a multiple of {groups_key} = {groups}"
            )
        if not 0 < group_used < groups:
            raise reader.fail(f"{group_used_key} = {group_used} must be in 1..{groups - 1}")


def _get(metadata: dict[str, Any], key: str, default: int) -> int:
    value = _uint(metadata, key)
    return default if value is None else value


@dataclass(frozen=True)
class _HeadSize:
    """The head sizes llama.cpp derives for one kind of layer (full or sliding-window)."""

    key: int
    value: int
    rope: int


def _head_sizes(
    arch: str, metadata: dict[str, Any], n_head: int
) -> tuple[_HeadSize, _HeadSize] | None:
    """(full, sliding-window) head sizes as load_hparams derives them; None without an embedding
    length (llama.cpp then refuses the file)."""
    embd = "features_length" if arch == "wavtokenizer-dec" else "embedding_length"
    n_embd = _uint(metadata, f"{arch}.{embd}")
    if n_embd is None:
        return None
    full = _HeadSize(0, 0, 0)  # without heads llama.cpp reads none of these keys
    if n_head > 0:
        key = _get(metadata, f"{arch}.attention.key_length", n_embd // n_head)
        value = _get(metadata, f"{arch}.attention.value_length", n_embd // n_head)
        full = _HeadSize(key, value, _get(metadata, f"{arch}.rope.dimension_count", key))
    swa = _HeadSize(
        _get(metadata, f"{arch}.attention.key_length_swa", full.key),
        _get(metadata, f"{arch}.attention.value_length_swa", full.value),
        _get(metadata, f"{arch}.rope.dimension_count_swa", full.rope),
    )
    return full, swa


def _check_head_counts(
    reader: _Reader, arch: str, metadata: dict[str, Any], n_layer: int
) -> list[int]:
    """Per-layer head counts; ggml_mul_mat / flash attention broadcast the KV heads, so they
    must divide the query heads."""
    heads_key, kv_key = f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"
    heads = _per_layer(reader, metadata, heads_key, n_layer) or [0] * n_layer
    heads_kv = _per_layer(reader, metadata, kv_key, n_layer) or heads
    for il, (n_head, n_head_kv) in enumerate(zip(heads, heads_kv, strict=True)):
        if n_head_kv > 0 and n_head % n_head_kv:
            raise reader.fail(
                f"{heads_key} = {n_head} is not a multiple of {kv_key} = {n_head_kv} (layer {il})"
            )
    return heads


def _check_attention(
    reader: _Reader, arch: str, metadata: dict[str, Any], n_layer: int
) -> _HeadSize | None:
    """Attention hyperparameters that pass loading but abort when the context is created or at
    the first decode: heads, sliding-window layers, head sizes, rope dimensions. Returns layer
    0's head sizes (None without embedding_length: llama.cpp refuses the file)."""
    heads = _check_head_counts(reader, arch, metadata, n_layer)
    swa = _swa_layers(reader, arch, metadata, n_layer)
    if swa is not None:
        _check_swa(reader, arch, metadata, n_layer, swa)
    sizes = _head_sizes(arch, metadata, heads[0])
    if sizes is None:
        return None
    full, sliding = sizes
    layer0 = sliding if swa is not None and swa[1][0] else full
    if heads[0] == 0:
        return layer0  # llama.cpp reads no head size nor rope dimensions without heads
    if f"{arch}.rope.dimension_count" in metadata:
        _check_rope(reader, f"{arch}.rope.dimension_count", full)
    swa_keys = (f"{arch}.attention.key_length_swa", f"{arch}.rope.dimension_count_swa")
    if any(key in metadata for key in swa_keys):
        _check_rope(reader, swa_keys[1], sliding)
    _check_head_equality(reader, arch, full, sliding, layer0)
    _check_mrope(reader, arch, metadata, layer0.rope)
    return layer0


def _check_rope(reader: _Reader, key: str, size: _HeadSize) -> None:
    """The rope kernel asserts n_dims <= head size and n_dims even."""
    if size.rope % 2:
        raise reader.fail(f"{key} = {size.rope} must be even")
    if size.rope > size.key:
        raise reader.fail(f"{key} = {size.rope} exceeds the head size (key_length) {size.key}")


def _check_head_equality(
    reader: _Reader, arch: str, full: _HeadSize, sliding: _HeadSize, layer0: _HeadSize
) -> None:
    """Graphs (src/models/<arch>.cpp) that assert, on layer 0, equal key and value head sizes
    (and rope dimensions), or gemma4 on every layer."""
    pairs = [layer0] if arch in archs.HEADS_K_EQ_V or arch in archs.HEADS_K_EQ_V_EQ_ROT else []
    if arch in archs.HEADS_K_EQ_V_EVERY_LAYER:
        pairs = [full, sliding]
    for size in pairs:
        if size.key != size.value:
            raise reader.fail(
                f"{arch} needs attention.value_length == attention.key_length (after defaults), "
                f"got {size.value} and {size.key}"
            )
    if arch in archs.HEADS_K_EQ_V_EQ_ROT and layer0.rope != layer0.key:
        raise reader.fail(
            f"{arch} needs rope.dimension_count == attention.key_length (after defaults), "
            f"got {layer0.rope} and {layer0.key}"
        )


# -- sliding-window layers ----------------------------------------------------------------------


def _swa_mode(arch: str, metadata: dict[str, Any], n_main: int) -> tuple[bool, archs.SwaPattern]:
    """Whether load_arch_hparams turns sliding-window attention on, and the pattern it reads."""
    window = _uint(metadata, f"{arch}.attention.sliding_window")
    if arch in archs.SWA_ALWAYS:
        return True, archs.SWA_ALWAYS[arch]
    if arch in archs.SWA_IF_WINDOW:
        return bool(window), archs.SWA_IF_WINDOW[arch]
    if arch == "exaone4":
        return n_main == 64, archs.SWA_DEFAULT
    if arch == "llama4":
        return window != 0, archs.SWA_DEFAULT
    return False, None


def _swa_pattern(n_pattern: int, dense_first: bool, n_main: int) -> list[bool]:
    """llama_hparams::set_swa_pattern."""
    if n_pattern == 0:
        return [True] * n_main
    if dense_first:
        return [il % n_pattern != 0 for il in range(n_main)]
    return [il % n_pattern < n_pattern - 1 for il in range(n_main)]


def _swa_layers(
    reader: _Reader, arch: str, metadata: dict[str, Any], n_layer: int
) -> tuple[bool, list[bool]] | None:
    """(sliding-window attention on for create_memory, which layers use it) as llama.cpp sets
    them; None where it refuses the pattern key (a throw: nothing to check)."""
    if arch == "deepseek4" or (
        arch == "dflash" and (_uint(metadata, f"{arch}.hyper_connection.count") or 0) > 0
    ):
        return True, [True] * n_layer
    key = f"{arch}.attention.sliding_window_pattern"
    value = metadata.get(key)
    if arch in archs.SWA_OWN_MEMORY:  # on for the graph, but no generic create_memory assert
        flags = _pattern_flags(value, n_layer)
        return None if flags is None else (False, flags)
    n_main = n_layer - (_uint(metadata, f"{arch}.nextn_predict_layers") or 0)
    on, spec = _swa_mode(arch, metadata, n_main)
    if not on:
        return False, [False] * n_layer
    if isinstance(value, GgufArray):
        flags = _pattern_flags(value, n_layer)
        return None if flags is None else (True, flags)
    if spec is None:
        return None  # the arch requires the pattern array
    n_pattern = spec[0] if value is None else _uint(metadata, key)
    if n_pattern is None:
        return None  # not an integer
    return True, _swa_pattern(n_pattern, spec[1], n_main) + [False] * (n_layer - n_main)


def _pattern_flags(value: Any, n_layer: int) -> list[bool] | None:
    """A sliding_window_pattern array read as is (nextn layers included, missing entries
    false); None where llama.cpp refuses it (a throw)."""
    if not isinstance(value, GgufArray):
        return None
    if value.item_kind not in (_UINT32, _INT32, _BOOL) or value.values is None:
        return None
    flags = [v != 0 for v in value.values[:n_layer]]
    return flags + [False] * (n_layer - len(flags))


def _check_swa(
    reader: _Reader,
    arch: str,
    metadata: dict[str, Any],
    n_layer: int,
    swa: tuple[bool, list[bool]],
) -> None:
    """create_memory asserts that a sliding-window model has a sliding-window layer (an encoder
    without KV cache needs a full-attention one too); gemma3n and gemma4 also need the layers
    whose KV cache later layers reuse."""
    on, flags = swa
    if on:
        _require_layer(reader, arch, flags, sliding=True)
        if arch in archs.SWA_WITHOUT_KV_CACHE:
            _require_layer(reader, arch, flags, sliding=False)
    if arch == "gemma3n":
        _check_kv_reuse(reader, arch, metadata, flags, archs.GEMMA3N_KV_FROM_START)
    elif arch == "gemma4":
        shared = _uint(metadata, f"{arch}.attention.shared_kv_layers") or 0
        if n_layer - shared < 2:
            raise reader.fail(
                f"{arch}.attention.shared_kv_layers = {shared} leaves {n_layer - shared} of "
                f"{n_layer} layers with a KV cache of their own: llama.cpp needs at least 2"
            )
        _check_kv_reuse(reader, arch, metadata, flags, n_layer - shared)


def _require_layer(reader: _Reader, arch: str, flags: list[bool], sliding: bool) -> None:
    if sliding not in flags:
        kind = "sliding-window" if sliding else "full-attention"
        raise reader.fail(
            f"{arch}.attention.sliding_window_pattern makes no layer {kind}, but {arch} with "
            "sliding-window attention needs one"
        )


def _check_kv_reuse(
    reader: _Reader, arch: str, metadata: dict[str, Any], flags: list[bool], start: int
) -> None:
    """Layers from ``start`` on reuse the KV cache of layer start-1 (full attention) or start-2
    (sliding-window): llama_kv_cache asserts that layer is of the same kind."""
    n_main = len(flags) - (_uint(metadata, f"{arch}.nextn_predict_layers") or 0)
    later = flags[start:n_main]
    for sliding, source in ((False, start - 1), (True, start - 2)):
        if sliding in later and flags[source] != sliding:
            kind = "sliding-window" if sliding else "full-attention"
            raise reader.fail(
                f"{arch}: the {kind} layers from {start} on reuse the KV cache of layer "
                f"{source}, which {arch}.attention.sliding_window_pattern does not make {kind}"
            )


# -- M-RoPE -------------------------------------------------------------------------------------


def _sections(reader: _Reader, metadata: dict[str, Any], key: str) -> list[int] | None:
    """The four int32 M-RoPE sections llama.cpp reads (zeros when absent); None where it refuses
    the key's type or length (a throw)."""
    value = metadata.get(key)
    if value is None:
        return [0] * 4
    if isinstance(value, GgufArray):
        if value.item_kind not in (_UINT32, _INT32, _BOOL) or value.count != 4:
            return None
        assert value.values is not None
        return [v - (1 << 32) if v >= 1 << 31 else int(v) for v in value.values]
    return [value] * 4 if reader.types[key] == _INT32 else None


def _check_mrope(reader: _Reader, arch: str, metadata: dict[str, Any], n_rot: int) -> None:
    """The M-RoPE kernel asserts some of the first three sections > 0 and their sum <= the head
    size, and divides by that sum (a negative section can make it 0). Real models' sections add
    up to n_rot / 2, so the sum is bounded by n_rot here."""
    key = f"{arch}.rope.dimension_sections"
    sections = _sections(reader, metadata, key)
    if sections is None:
        return
    used = (
        arch in archs.MROPE_ALWAYS
        or (arch in archs.MROPE_IF_FIRST_TWO and sections[0] > 0 and sections[1] > 0)
        or (arch in archs.MROPE_IF_ANY and any(sections))
    )
    if used and (min(sections) < 0 or max(sections[:3]) <= 0 or sum(sections) > n_rot):
        raise reader.fail(
            f"{key} = {sections}: {arch} uses M-RoPE, which needs sections >= 0, one of the "
            f"first three > 0, and a sum of at most the rope dimensions ({n_rot})"
        )


# -- asserts of single architectures --------------------------------------------------------------

Rule = tuple[bool, str]  # (holds, what must hold)


@dataclass(frozen=True)
class _Model:
    """The header as the per-architecture rules read it, with llama.cpp's per-layer values."""

    reader: _Reader
    arch: str
    metadata: dict[str, Any]
    tensors: dict[str, tuple[list[int], int]]  # name: (dims, GGML type)
    n_layer: int  # block_count
    layer0: _HeadSize | None  # head sizes of layer 0; None without embedding_length

    def key(self, name: str, default: float = 0) -> float:
        """{arch}.name if it is a number, else the default (llama.cpp throws on other types; a
        required key that is absent reads as 0: llama.cpp refuses the file anyway)."""
        value = self.metadata.get(f"{self.arch}.{name}", default)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return value if number else default

    def has(self, name: str) -> bool:
        return f"{self.arch}.{name}" in self.metadata

    def layers(self, name: str, n: int | None = None) -> list[int]:
        """{arch}.name for each of n layers (block_count by default), zeros when absent."""
        n = self.n_layer if n is None else n
        return _per_layer(self.reader, self.metadata, f"{self.arch}.{name}", n) or [0] * n

    def ne1(self, name: str) -> int | None:
        """ne[1] of a tensor (1 for a vector), None when the file has no such tensor."""
        dims = self.tensors[name][0] if name in self.tensors else None
        return None if dims is None else [*dims, 1][1]

    @cached_property
    def n_main(self) -> int:
        """Layers of the main graph: block_count - nextn_predict_layers."""
        return self.n_layer - (_uint(self.metadata, f"{self.arch}.nextn_predict_layers") or 0)

    @cached_property
    def heads(self) -> list[int]:
        return self.layers("attention.head_count")

    @cached_property
    def heads_kv(self) -> list[int]:
        key = f"{self.arch}.attention.head_count_kv"
        return _per_layer(self.reader, self.metadata, key, self.n_layer) or self.heads

    @cached_property
    def recurrent(self) -> list[bool]:
        """Which main layers are recurrent (gguf_archs.RECURRENT_*)."""
        arch, n = self.arch, self.n_main
        if arch in archs.RECURRENT_ALL:
            return [True] * n
        if arch in archs.RECURRENT_WITHOUT_KV:
            return [kv == 0 for kv in self.heads_kv[:n]]
        if arch in archs.RECURRENT_WITHOUT_KV_OR_FF:
            ff = self.layers("feed_forward_length")
            return [kv == 0 and f == 0 for kv, f in zip(self.heads_kv[:n], ff, strict=False)]
        if arch in archs.RECURRENT_INTERVAL and self.has("attention.recurrent_layers"):
            return [v != 0 for v in self.layers("attention.recurrent_layers")[:n]]
        if arch in archs.RECURRENT_INTERVAL:
            interval = self.key("full_attention_interval", archs.RECURRENT_INTERVAL[arch])
            return [interval > 0 and (il + 1) % interval != 0 for il in range(n)]
        return [False] * n


def _divides(d: float, n: float) -> bool:
    """d > 0 and d divides n: llama.cpp divides n by d."""
    return d > 0 and n % d == 0


def _hparam_rules(m: _Model) -> list[Rule]:
    """GGML_ASSERTs of load_arch_hparams (src/models/<arch>.cpp) on plain keys."""
    if m.arch == "gemma-embedding":
        n_embd = m.key("embedding_length")
        return [
            (m.key("dense_2_feat_in") in (0, n_embd), "dense_2_feat_in is 0 or embedding_length"),
            (m.key("dense_3_feat_out") in (0, n_embd), "dense_3_feat_out is 0 or embedding_length"),
        ]  # fmt: skip
    if m.arch == "nanbeige":
        loops = m.key("num_loops", 1)
        return [
            (loops > 0 and m.n_main * loops <= LLAMA_MAX_LAYERS, "num_loops x layers in 1..512")
        ]
    if m.arch == "hrm_text":
        stack, high = m.key("hrm.layers_per_stack"), m.key("hrm.h_cycles")
        low = m.key("hrm.l_cycles")
        return [
            (min(stack, high, low) > 0, "hrm.layers_per_stack, h_cycles and l_cycles > 0"),
            (stack * high * (low + 1) == m.n_main, "layers_per_stack x h_cycles x (l_cycles + 1) "
             "== block_count - nextn_predict_layers"),
        ]  # fmt: skip
    if m.arch == "minimax-m3":
        return [(m.key("attention.indexer.block_size") > 0, "attention.indexer.block_size > 0")]
    if m.arch == "glm5-next":
        kpool, top_k = m.key("attention.indexer.kpool"), m.key("attention.indexer.top_k")
        return [
            (kpool > 1 and top_k % kpool == 0, "attention.indexer.kpool > 1, dividing top_k"),
            (m.key("hyper_connection.count") == 4, "hyper_connection.count == 4"),
        ]
    if m.arch == "bailingmoe3":
        safe_gate = m.metadata.get(f"{m.arch}.kda.safe_gate", True)
        return [(safe_gate is True and m.key("kda.gate_lower_bound") < 0,
                 "kda.safe_gate true and kda.gate_lower_bound < 0")]  # fmt: skip
    if m.arch == "dflash" and m.key("hyper_connection.count") > 0:
        return [(m.key("attention.sliding_window") > 0, "attention.sliding_window > 0")]
    if m.arch == "deepseek4":
        ratios = m.metadata.get(f"{m.arch}.attention.compress_ratios")
        count = ratios.count if isinstance(ratios, GgufArray) else 0
        return [(count <= LLAMA_MAX_LAYERS, "attention.compress_ratios has at most 512 entries")]
    return []


def _table_rules(m: _Model) -> list[Rule]:
    """Loader asserts and divisions the gguf_archs tables describe."""
    rules = [(m.key(name) > 0, f"{name} > 0")
             for name in archs.POSITIVE_KEYS.get(m.arch, ()) if m.has(name)]  # fmt: skip
    past_dense_lead = m.key("leading_dense_block_count") < m.n_main
    if m.arch in archs.EXPERTS_REQUIRED or (
        m.arch in archs.EXPERTS_REQUIRED_PAST_DENSE_LEAD and past_dense_lead
    ):
        rules.append((m.key("expert_count") > 0, "expert_count > 0"))
    if m.arch in archs.HEAD_COUNT_DIVIDES and archs.HEAD_COUNT_DIVIDES[m.arch] in (None, m.n_main):
        rules.append((m.heads[0] > 0, "attention.head_count > 0 (layer 0)"))
    if m.arch in archs.RECURRENT_INTERVAL and not m.has("attention.recurrent_layers"):
        rules.append((m.key("full_attention_interval", 1) > 0, "full_attention_interval > 0"))
    if m.arch in archs.SSM_INNER_TWICE_EMBEDDING:
        inner, n_embd = m.key("ssm.inner_size"), m.key("embedding_length")
        rules.append((inner == 2 * n_embd, "ssm.inner_size == 2 x embedding_length"))
    if m.arch in archs.MTP_TRUNK_OPTIONAL and m.tensors and 0 < m.n_main < m.n_layer:
        rules.append(("blk.0.attn_norm.weight" in m.tensors,
                      "the main layers' tensors (blk.0.attn_norm.weight): a file of "
                      "nextn_predict_layers only is for MTP drafting"))  # fmt: skip
    return rules


def _ssm_rules(m: _Model) -> list[Rule]:
    """ssm.* sizes the recurrent layers' graph divides by and asserts on (SSM_LAYOUT)."""
    layout = archs.SSM_LAYOUT.get(m.arch)
    if layout is None or not any(m.recurrent):
        return []
    inner, state = m.key("ssm.inner_size"), m.key("ssm.state_size")
    heads, groups = m.key("ssm.time_step_rank"), m.key("ssm.group_count")
    if layout == "mamba2":
        holds = _divides(heads, inner) and _divides(groups, inner)
        return [(holds, "ssm.time_step_rank and ssm.group_count > 0, dividing ssm.inner_size")]
    if layout == "plamo2":
        holds = groups == 0 and _divides(heads, inner)
        return [(holds, "ssm.group_count 0 and ssm.time_step_rank > 0 dividing ssm.inner_size")]
    holds = heads > 0 and _divides(groups, heads) and inner == state * heads
    what = "ssm.group_count > 0 dividing ssm.time_step_rank > 0, and ssm.inner_size == "
    return [(holds, what + "ssm.state_size x ssm.time_step_rank")]


def _attention_rules(m: _Model) -> list[Rule]:
    """Graph asserts on MLA, sparse-attention indexer and DeepSeek-V4 attention sizes."""
    if m.layer0 is None:
        return []
    rope, rules = m.layer0.rope, []
    if m.arch in archs.INDEXER_ROPE and m.has("attention.indexer.key_length"):
        rules.append((rope <= m.key("attention.indexer.key_length"),
                      "attention.indexer.key_length >= the rope dimensions (layer 0)"))  # fmt: skip
    if m.arch in archs.INDEXER_SHARED_AFTER_FULL and m.has("attention.indexer.types"):
        types = m.layers("attention.indexer.types", m.n_main)
        first = next((il for il, recurrent in enumerate(m.recurrent) if not recurrent), None)
        rules.append((first is None or types[first] != 0,
                      "attention.indexer.types != 0 on the first attention layer"))  # fmt: skip
    if m.arch in archs.MLA_NOPE:
        mla = m.key("attention.key_length_mla"), m.key("attention.value_length_mla")
        key = mla[0] if all(mla) else m.layer0.key
        rules.append((key > rope, "attention.key_length_mla (else key_length) > rope dimensions"))
    if m.arch in archs.NOPE_ONLY and not all(m.recurrent):
        rules.append((rope == 0, "rope.dimension_count == 0 (its MLA has no rope)"))
    hc = m.key("hyper_connection.count")
    if m.arch in archs.DSV4_ATTENTION and (m.arch != "dflash" or hc > 0):
        groups = m.key("attention.output_group_count")
        rules += [(hc == 4, "hyper_connection.count == 4"),
                  (_divides(groups, m.heads[0]),
                   "attention.output_group_count > 0, dividing head_count")]  # fmt: skip
    return rules


def _rwkv_rules(m: _Model) -> list[Rule]:
    """RWKV graphs: the token shift each supports, and the wkv heads embedding_length splits
    into (divided by at load and in the graph)."""
    shift = archs.TOKEN_SHIFT.get(m.arch)
    if shift is None:
        return []
    size, n_embd = m.key("wkv.head_size"), m.key("embedding_length")
    whole = 0 < size <= n_embd and n_embd % size == 0
    rules = [(m.key("token_shift_count", 2) == shift, f"token_shift_count == {shift}"),
             (whole, "wkv.head_size > 0, dividing embedding_length")]  # fmt: skip
    if m.arch in archs.WKV_KV_GROUPS and whole:
        n_head = n_embd // size
        groups_ok = all(kv in (0, n_head) or n_head % kv == 0 for kv in m.heads_kv[: m.n_main])
        rules.append((groups_ok, "head_count_kv dividing embedding_length / wkv.head_size"))
    if m.arch == "rwkv6" and m.tensors:
        names = ("time_mix_lerp_fused", "time_mix_lerp_w")
        lerp = [{f"blk.{il}.{name}.weight" for name in names} & m.tensors.keys()
                for il in range(m.n_main)]  # fmt: skip
        rules.append((all(lerp), "blk.N.time_mix_lerp_fused or time_mix_lerp_w in every layer"))
    return rules


def _graph_rules(m: _Model) -> list[Rule]:
    """Graph and loader asserts of single architectures on per-layer values."""
    if m.arch == "deepseek2-ocr" and m.layer0 is not None:
        head = m.key("embedding_length") // m.heads[0] if m.heads[0] else 0
        return [
            (head > 0 and m.layer0.key == m.layer0.value == head,
             "key_length == value_length == embedding_length / head_count"),
            (abs(m.key("rope.freq_base", 10000.0) - 10000.0) < 1e-4, "rope.freq_base == 10000"),
        ]  # fmt: skip
    if m.arch in ("lfm2", "lfm2moe"):
        return _lfm2_rules(m)
    if m.arch == "minimax-m3":
        index_heads = m.key("attention.indexer.head_count")
        sparse = m.heads_kv[int(m.key("leading_dense_block_count")) : m.n_main]
        holds = all(kv == index_heads for kv in sparse) and _divides(index_heads, m.heads[0])
        what = "attention.indexer.head_count == head_count_kv of the layers past "
        return [(not sparse or holds, what + "leading_dense_block_count, dividing head_count")]
    if m.arch in ("nemotron_h", "nemotron_h_moe") and m.key("expert_count") > 0:
        ffn = zip(m.layers("feed_forward_length"), m.layers("expert_used_count"), strict=True)
        holds = all(used > 0 for ff, used in list(ffn)[: m.n_main] if ff > 0)
        return [(holds, "expert_used_count > 0 on every layer with feed_forward_length > 0")]
    if m.arch == "wavtokenizer-dec":
        posnet, convnext = m.key("posnet.embedding_length"), m.key("convnext.embedding_length")
        return [
            (m.key("posnet.block_count") <= 6, "posnet.block_count <= 6 (its layer kinds)"),
            (posnet == convnext, "posnet.embedding_length == convnext.embedding_length"),
        ]
    if m.arch == "eagle3":
        return [(m.n_main == 1, "block_count - nextn_predict_layers == 1")]
    return []


def _lfm2_rules(m: _Model) -> list[Rule]:
    """LFM2: attention layers (head_count_kv > 0) assert equal key and value heads (layer 0's
    and their own), short-conv layers a conv of at least 2, and a centred (non-causal) conv an
    odd one, else a one-token sequence trips its size assert."""
    kv = m.heads_kv[: m.n_main]
    sizes = _head_sizes(m.arch, m.metadata, m.heads[0])
    same = sizes is not None and len({*(s.key for s in sizes), *(s.value for s in sizes)}) == 1
    conv, causal = m.key("shortconv.l_cache"), m.metadata.get(f"{m.arch}.attention.causal", True)
    return [
        (not any(kv) or same, "equal key_length, value_length and their _swa values"),
        (all(kv) or conv > 1, "shortconv.l_cache > 1"),
        (all(kv) or causal is not False or conv % 2 == 1,
         "an odd shortconv.l_cache when attention.causal is false"),
    ]  # fmt: skip


def _tensor_rules(m: _Model) -> list[Rule]:
    """Loader and graph asserts comparing tensor shapes or types with the hyperparameters."""
    rules = []
    if m.arch == "laguna" and m.layer0 is not None:
        widths = [(m.ne1(f"blk.{il}.attn_gate.weight"), h) for il, h in enumerate(m.heads)]
        ok = all(w in (None, h, m.layer0.key * h) for w, h in widths[: m.n_main])
        rules.append((ok, "blk.N.attn_gate.weight of head_count or key_length x head_count rows"))
    if m.arch == "jina-bert-v2":
        n_ff = m.layers("feed_forward_length")[0]
        ups = [m.ne1(f"blk.{il}.ffn_up.weight") for il in range(m.n_main)]
        ok = all(up in (None, n_ff, 2 * n_ff) for up in ups)
        rules.append((ok, "blk.N.ffn_up.weight of feed_forward_length or twice as many rows"))
    if m.arch in ("qwen3vl", "qwen3tts"):
        out, embd = m.ne1("output.weight"), m.ne1("token_embd.weight")
        rules.append((out is None or embd is None or out <= embd,
                      "output.weight with no more rows than token_embd.weight"))  # fmt: skip
    if m.arch in ("eagle3", "dflash") and "d2t" in m.tensors:
        rules.append((m.tensors["d2t"][1] == lib.GGML_TYPE_I64, "a d2t tensor of type I64"))
    if m.arch == "dflash" and "markov_w1.weight" in m.tensors:
        block_size = _uint(m.metadata, f"{m.arch}.block_size") or 0
        rules.append((block_size > 0, "block_size > 0 with a DSpark Markov head (markov_w1)"))
    if m.arch == "glm-dsa":
        rules.append(_glm_dsa_indexer_rule(m))
    return rules


def _glm_dsa_indexer_rule(m: _Model) -> Rule:
    """glm-dsa loads the indexer tensors as optional, but its graph multiplies by them on every
    layer attention.indexer.types (or its default) marks full: a null-tensor dereference. Only
    layers whose attn_norm is there are checked (without it llama.cpp throws, or the file is
    MTP-only, refused by the MTP rule)."""
    if m.has("attention.indexer.types"):
        full = [t != 0 for t in m.layers("attention.indexer.types", m.n_main)]
    elif m.key("context_length") < archs.GLM_DSA_PATTERN_CONTEXT:
        full = [True] * m.n_main
    else:
        full = [il in archs.GLM_5_2_FULL_INDEXER_LAYERS for il in range(m.n_main)]
    missing = [
        f"blk.{il}.{name}.weight"
        for il in range(m.n_main)
        if full[il] and f"blk.{il}.attn_norm.weight" in m.tensors
        for name in archs.GLM_DSA_FULL_INDEXER_TENSORS
        if f"blk.{il}.{name}.weight" not in m.tensors
    ]
    what = "the indexer tensors on each full-indexer layer (attention.indexer.types)"
    return (not missing, f"{what}; {missing[0]} is missing" if missing else what)


_RULES = (_hparam_rules, _table_rules, _ssm_rules, _attention_rules, _rwkv_rules, _graph_rules,
          _tensor_rules)  # fmt: skip


def _check_arch_rules(m: _Model) -> None:
    for rules in _RULES:
        for holds, what in rules(m):
            if not holds:
                raise m.reader.fail(f"{m.arch} needs {what}")


# -- vocabulary and tensors ----------------------------------------------------------------------


def _check_vocabulary(reader: _Reader, metadata: dict[str, Any]) -> None:
    """What llama_vocab::load asserts on, divides by, overflows the stack with, spends minutes
    on or throws C++ library errors for (std::out_of_range as the message) while loading the
    vocabulary."""
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get(_TOKENS)
    if model in ("none", "no_vocab") or not isinstance(tokens, GgufArray):
        return  # no vocabulary is read (the Vocab handle refuses the model), or llama.cpp throws
    words = tokens.strings
    if tokens.item_kind != _STRING or words is None:
        return  # llama.cpp throws
    if not words:  # the "test" tokenizer divides by the vocabulary size
        raise reader.fail(f"{_TOKENS} is empty")
    repeated = words.first_repeated()
    if repeated is not None:
        raise reader.fail(
            f"{_TOKENS} holds {words.kept(repeated).decode('utf-8', 'replace')!r} twice: "
            "llama.cpp needs distinct tokens"
        )
    types = _token_types(metadata, len(words))
    _check_trie_depth(reader, model, words, types)
    if model == "plamo2":  # its table's cost is cubic in a token's length
        in_table = None if types is None else types != _BYTE_TOKEN
        if problem := plamo2.table_problem(words.region, words.starts, in_table):
            raise reader.fail(problem)
    if model == "t5" and len(words) <= _UGM_LOAD_UNKNOWN:  # std::out_of_range at load
        raise reader.fail(
            f"a t5 (UGM) vocabulary of {len(words)} tokens: llama.cpp loads it with token "
            f"{_UGM_LOAD_UNKNOWN} as the unknown token, so it needs at least "
            f"{_UGM_LOAD_UNKNOWN + 1}"
        )
    byte_tokens = np.flatnonzero(types == _BYTE_TOKEN) if types is not None else ()
    if model == "bert" and len(byte_tokens):  # token_to_byte aborts for WordPiece
        raise reader.fail(
            f"a bert (WordPiece) vocabulary has byte tokens (type 6) in {_TOKEN_TYPES}"
        )
    if model in _SPELT_BYTE_MODELS:
        _check_byte_spelling(reader, words, byte_tokens)
    if model == "rwkv":
        _check_rwkv_bytes(reader, words)


def _token_types(metadata: dict[str, Any], n_tokens: int) -> np.ndarray | None:
    """Each token's type as llama.cpp reads them, or None where it reads none (every token is
    normal) or throws (not an int32 array, or shorter than the tokens)."""
    types = metadata.get(_TOKEN_TYPES)
    if not isinstance(types, GgufArray) or types.item_kind != _INT32:
        return None
    if types.values is None or len(types.values) < n_tokens:
        return None
    return np.fromiter(types.values, dtype=np.int32, count=n_tokens)


def _check_trie_depth(
    reader: _Reader, model: Any, words: StringTable, types: np.ndarray | None
) -> None:
    """No token of a trie vocabulary longer than MAX_TRIE_TOKEN_BYTES as the trie holds it
    (cut at a NUL; RWKV's unescaped), looked at only where the stored token is longer."""
    if model not in _TRIE_TOKEN_TYPES:
        return
    in_trie = _TRIE_TOKEN_TYPES[model]
    ends = np.append(words.starts[1:] - np.uint64(8), np.uint64(len(words.region)))
    for i in np.flatnonzero(ends - words.starts > MAX_TRIE_TOKEN_BYTES).tolist():
        if in_trie is not None and types is not None and types[i] not in in_trie:
            continue
        kept = words.kept(i)
        # An RWKV escape is at most 4 bytes for 1: a longer token is longer unescaped too.
        unescape = model == "rwkv" and len(kept) <= 4 * MAX_TRIE_TOKEN_BYTES + 3
        length = len(_rwkv_unescape(kept)) if unescape else len(kept)
        if length > MAX_TRIE_TOKEN_BYTES:
            raise reader.fail(
                f"token {i} of the {model} vocabulary is {length} bytes long (at most "
                f"{MAX_TRIE_TOKEN_BYTES}): llama.cpp's tokenizer goes one nested call deeper "
                "per byte of a token and would overflow the stack"
            )


def _check_byte_spelling(reader: _Reader, words: StringTable, byte_tokens: Any) -> None:
    """Every byte token (type 6) spelt <0xXX>, where llama.cpp reads its byte."""
    for i in byte_tokens:
        text = words.kept(int(i))
        if not _BYTE_SPELLING.fullmatch(text):
            raise reader.fail(
                f"token {i} is a byte token (type 6 in {_TOKEN_TYPES}) spelt "
                f"{text.decode('utf-8', 'replace')!r}: llama.cpp reads a byte token's value "
                "from its text, which must be <0xXX>"
            )


def _rwkv_unescape(word: bytes) -> bytes:
    """A token as llama.cpp's RWKV tokenizer reads it (llama_unescape_rwkv_token), after it
    is cut at a NUL and an empty one renamed (StringTable.kept)."""
    out, escaping, hex_left, acc = bytearray(), False, 0, 0
    for c in word:
        if hex_left:
            acc = ((acc << 4) + ((c - 87) if c >= 97 else (c - 48))) & 0xFF
            hex_left -= 1
            if not hex_left:
                out.append(acc)
                acc = 0
        elif escaping:
            escaping = False
            if c == 120:  # \xNN
                hex_left = 2
            else:
                out.append({116: 9, 110: 10, 114: 13}.get(c, c))  # \t \n \r, else itself
        elif c == 92:
            escaping = True
        else:
            out.append(c)
    return bytes(out)


def _check_rwkv_bytes(reader: _Reader, words: StringTable) -> None:
    """llama.cpp's RWKV tokenizer never advances (it appends tokens until memory runs out)
    when text starts like some token but no token matches at its first byte: every byte that
    begins a token must be a token of its own (real RWKV vocabularies hold all 256)."""
    texts = [_rwkv_unescape(words.kept(i)) for i in range(len(words))]
    missing = {t[0] for t in texts if t} - {t[0] for t in texts if len(t) == 1}
    if missing:
        raise reader.fail(
            f"an rwkv vocabulary has tokens starting with byte {min(missing):#04x} but not that "
            "byte as a token: llama.cpp's tokenizer would loop without end"
        )


def _check_tied_output(reader: _Reader, tensors: list[Any]) -> None:
    """llama-model.cpp asserts that an NVFP4 output tied to token_embd.weight (no output.weight)
    comes without the scale tensors of a separate output head."""
    types = {name: ggml_type for name, _, ggml_type, _ in tensors}
    scales = sorted({"output.scale", "output.input_scale"} & types.keys())
    tied = "output.weight" not in types
    if tied and scales and types.get("token_embd.weight") == lib.GGML_TYPE_NVFP4:
        raise reader.fail(
            f"token_embd.weight (NVFP4) doubles as the output, which cannot have {scales[0]}"
        )


def _check_enums(reader: _Reader, arch: str, metadata: dict[str, Any]) -> None:
    key = f"{arch}.rope.scaling.type"
    if key in metadata and metadata[key] not in _ROPE_SCALING_TYPES:
        raise reader.fail(
            f"{key} = {metadata[key]!r} is not one of {', '.join(_ROPE_SCALING_TYPES)}"
        )
    for name, allowed in (
        ("pooling_type", _POOLING_TYPES),
        ("classifier.pooling_type", _POOLING_TYPES),
        ("expert_gating_func", _EXPERT_GATING_FUNCS),
    ):
        value = _uint(metadata, f"{arch}.{name}")
        if value is not None and value not in allowed:
            raise reader.fail(
                f"{arch}.{name} = {value} is out of range {allowed.start}..{allowed.stop - 1}"
            )


def _check_projector_epsilons(reader: _Reader, metadata: dict[str, Any]) -> None:
    """libmtmd passes its layer norms' epsilons to ggml as they are, and ggml's norm asserts
    (aborts) on a negative or NaN one when the first image or sound is encoded."""
    for key, value in metadata.items():
        epsilon = key.startswith("clip.") and "epsilon" in key and isinstance(value, float)
        if epsilon and not (value > 0 and math.isfinite(value)):
            raise reader.fail(f"{key} = {value} must be a positive finite number")


def _check_hyperparameters(
    reader: _Reader, metadata: dict[str, Any], tensors: list[Any], kind: Kind
) -> None:
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise reader.fail("general.architecture is missing")
    _check_header_types(reader, metadata)
    # llama.cpp reads no hyperparameters for adapters, nor for a "clip" model loaded as a
    # model (it refuses that one after loading its tensors). general.type is never consulted:
    # the model loader does not read it, so a model claiming to be an adapter is still a model.
    if kind == "projector":
        _check_projector_epsilons(reader, metadata)
    if kind != "model" or arch == "clip":
        return
    _check_generic(reader, arch, metadata)
    n_layer = _check_layers(reader, arch, metadata, tensors)
    if n_layer is not None:  # else llama.cpp refuses the file: block_count is required
        _check_experts(reader, arch, metadata, n_layer)
        layer0 = _check_attention(reader, arch, metadata, n_layer)
        shapes = {name: (dims, ggml_type) for name, dims, ggml_type, _ in tensors}
        _check_arch_rules(_Model(reader, arch, metadata, shapes, n_layer, layer0))
    _check_enums(reader, arch, metadata)
    _check_vocabulary(reader, metadata)
    _check_tied_output(reader, tensors)
    n_embd = metadata.get(f"{arch}.embedding_length")
    embeddings = [t for t in tensors if t[0] == "token_embd.weight"]
    if embeddings and isinstance(n_embd, int) and embeddings[0][1][0] != n_embd:
        raise reader.fail(
            f"token_embd.weight has rows of {embeddings[0][1][0]}, "
            f"{arch}.embedding_length is {n_embd}"
        )


_POSITION_TABLE = "position_embd.weight"  # llama.cpp's LLM_TENSOR_POS_EMBD
_SPLIT_NAME = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def _read_file(path: Path) -> tuple[_Reader, dict[str, Any], list[Any]]:
    """Header of one file, with its own tensors checked against its size."""
    try:
        if not path.is_file():
            what = "is not a regular file" if path.exists() else "not found"
            raise ModelLoadError(f"model file {what}: {path}")
        size = path.stat().st_size
        if size < 24:
            raise InvalidModelError(f"{path} is not a valid GGUF file: only {size} bytes")
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            reader = _Reader(data, path)
            metadata, tensors = _read_header(reader)
            _check_tensors(reader, metadata, tensors)
            reader.data = b""  # the mapping closes here; later checks use the parsed header only
    except OSError as error:  # a name too long, no permission: is_file() lets those through
        raise ModelLoadError(f"cannot read {path}: {error.strerror or error}") from None
    return reader, metadata, tensors


def read_gguf_tensors(path: Path) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]]]:
    """The metadata and tensors of one file, its header checked: each tensor's name,
    dimensions, GGML type and the absolute file offset of its data (within the file)."""
    reader, metadata, tensors = _read_file(path)
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


def validate_gguf(
    path: Path, kind: Kind = "model", overrides: Mapping[str, int | float | str] | None = None
) -> tuple[_Reader, dict[str, Any]]:
    """Raise ModelLoadError / InvalidModelError unless ``path`` looks safe to hand to llama.cpp.
    For a split model, ``path`` is the first part and every part is checked. ``kind`` is how the
    file will be loaded: as a model (llama_model_load_from_file, whatever its general.type says;
    every hyperparameter check), as a LoRA adapter (header and tensors only: its loader reads
    no model hyperparameters) or as a multimodal projector (header, tensors and the epsilons
    ggml asserts on; the rest is tried in a child process: ``projector_probe``). A model's
    ``overrides`` (``kv_overrides``) are checked as the values llama.cpp will read. Returns the
    first part's header as llama.cpp will read it (the overrides applied)."""
    reader, metadata, tensors = _read_file(path)
    count = metadata.get("split.count", 1)
    if isinstance(count, int) and count > 1:
        for part in split_parts(path, count)[1:]:
            tensors = tensors + _read_file(part)[2]
    _check_hyperparameters(reader, metadata, tensors, kind)
    reader.position_rows = next(
        (int(dims[1]) for name, dims, _, _ in tensors if name == _POSITION_TABLE and len(dims) > 1),
        None,
    )
    if overrides and kind == "model":
        reader, metadata = _overridden(reader, metadata, overrides)
        _check_hyperparameters(reader, metadata, tensors, kind)
    return reader, metadata


def _overridden(
    reader: _Reader, metadata: dict[str, Any], overrides: Mapping[str, int | float | str]
) -> tuple[_Reader, dict[str, Any]]:
    """The header as llama.cpp's loader reads it with ``overrides``: an override instead of the
    file's value (or where it has none), read by any getter of its kind (an integer one by any
    integer type); an array too, where llama.cpp reads the key with get_key (the override comes
    before the type check), not where it reads the file's array (``gguf_archs.
    READ_ONLY_FROM_FILE``). Refused where llama.cpp would ignore it, and these checks would pass
    a header it never reads: an override of another kind than the file's value (its getter
    reads the file's kind, and warns), or of a key the file lacks that llama.cpp reads only from
    the file. The split.* keys, which tell llama.cpp the files to load, are never overridden:
    it would load parts never checked."""
    seen, merged = copy.copy(reader), dict(metadata)
    seen.types = dict(reader.types)
    seen.failing = f"{reader.path.name} with kv_overrides {dict(overrides)} would not load safely"
    arch = str(overrides.get("general.architecture", metadata.get("general.architecture")))
    for key, value in overrides.items():
        if key.startswith("split."):
            raise InvalidParameterError(
                f"kv_overrides[{key!r}]: the split.* keys say which files make up the model "
                "(llama.cpp would load parts that were never checked)"
            )
        array = isinstance(metadata.get(key), GgufArray)
        if archs.read_only_from_file(key, arch):
            if array:
                continue  # llama.cpp reads the array
            if key not in metadata:
                raise InvalidParameterError(
                    f"kv_overrides[{key!r}]: {reader.path.name} has no {key}, and llama.cpp "
                    "reads that key only from the file (it would ignore the override)"
                )
        kind = next(kind for type_, kind in _OVERRIDE_KINDS if isinstance(value, type_))
        if key in reader.types and not array and _stored_kind(reader.types[key]) != kind:
            raise InvalidParameterError(
                f"kv_overrides[{key!r}] = {value!r} is {_KIND_NAMES[kind]}; {reader.path.name} "
                f"stores {_KIND_NAMES[_stored_kind(reader.types[key])]} there (llama.cpp would "
                "ignore the override)"
            )
        merged[key] = value
        seen.types[key] = {"bool": _BOOL, "int": _INT32, "float": _FLOAT32, "str": _STRING}[kind]
    return seen, merged


def applied_overrides(
    metadata: Mapping[str, Any], overrides: Mapping[str, int | float | str]
) -> dict[str, str]:
    """The ``overrides`` llama.cpp applies to a model whose header validate_gguf returned as
    ``metadata`` (all but those of arrays it reads as such), each as llama_model_meta_val_str
    renders a value of its kind. That getter shows the file's values: guards of a loaded model
    read these over them."""
    return {
        key: meta_string(value)
        for key, value in overrides.items()
        if not isinstance(metadata.get(key), GgufArray)
    }


def meta_string(value: int | float | str) -> str:
    """A scalar as llama.cpp renders metadata (gguf_kv_to_str: std::to_string, true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:f}" if isinstance(value, float) else str(value)


_OVERRIDE_KINDS = ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"))
_KIND_NAMES = {"bool": "a boolean", "int": "an integer", "float": "a float", "str": "a string"}


def _stored_kind(gguf_type: int) -> str:
    """The kind of override llama.cpp's getter for a value of this GGUF type takes."""
    formats = {"?": "bool", "f": "float", "d": "float"}
    return "str" if gguf_type == _STRING else formats.get(_SCALARS.get(gguf_type, ""), "int")
