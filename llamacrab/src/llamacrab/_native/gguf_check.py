"""Validate a GGUF file's header before llama.cpp sees it.

llama.cpp rejects most malformed files cleanly, but some tampered values reach a GGML_ASSERT and
abort the whole process (a block_count that disagrees with the blk.N tensors, a non-positive norm
epsilon, ...). Everything that can be checked from the header is checked here, so such files raise
InvalidModelError instead. docs/native-aborts.md lists the asserts and which check covers each.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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
_UINT32, _INT32, _FLOAT32, _BOOL = 4, 5, 6, 7
_WALKED_PAST_END = 2**64 - 1  # SIZE_MAX from llamacrab_gguf_skip_strings
_MAX_DIMS = 4
_DEFAULT_ALIGNMENT = 32
# llama.cpp limits (src/llama-hparams.h) and enums (include/llama.h, src/llama-hparams.h).
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
_POOLING_TYPES = range(5)  # none, mean, cls, last, rank
_EXPERT_GATING_FUNCS = range(1, 5)  # softmax, sigmoid, softmax_weight, sqrt_softplus
# These archs reset expert_count <= 1 to 0 (and expert_used_count to 0) before the expert asserts.
_EXPERTS_RESET_ARCHS = ("hunyuan-dense", "hunyuan_vl")

Kind = Literal["model", "adapter", "projector"]


@dataclass(frozen=True)
class GgufArray:
    """A metadata array: its item type and length, and the values of numeric arrays short
    enough to be per-layer hyperparameters (longer ones, and string arrays, are skipped)."""

    item_kind: int
    count: int
    values: tuple[Any, ...] | None = None


class _Reader:
    def __init__(self, data: Any, path: Path) -> None:
        self.data, self.offset, self.path = data, 0, path
        self.types: dict[str, int] = {}  # GGUF value type of each metadata key

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
                values = None
                if count <= LLAMA_MAX_LAYERS:  # per-layer values; vocabulary arrays are skipped
                    values = struct.unpack_from(
                        f"<{count}{_SCALARS[item_kind]}", self.data, self.offset
                    )
                self.offset += size
                return GgufArray(item_kind, count, values)
            if item_kind != _STRING:
                raise self.fail(f"unsupported array item type {item_kind}")
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
        metadata[key] = reader.value(kind)
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


def _check_heads(reader: _Reader, arch: str, metadata: dict[str, Any], n_layer: int) -> None:
    """Head counts and rope dimensions that pass loading but abort in the graph (ggml_mul_mat /
    flash attention broadcasting, the rope kernel)."""
    heads_key, kv_key = f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"
    heads = _per_layer(reader, metadata, heads_key, n_layer) or [0] * n_layer
    heads_kv = _per_layer(reader, metadata, kv_key, n_layer) or heads
    for il, (n_head, n_head_kv) in enumerate(zip(heads, heads_kv, strict=True)):
        if n_head_kv > 0 and n_head % n_head_kv:
            raise reader.fail(
                f"{heads_key} = {n_head} is not a multiple of {kv_key} = {n_head_kv} (layer {il})"
            )
    if heads[0] == 0:
        return  # llama.cpp reads no head size nor rope dimensions without heads
    embd = "features_length" if arch == "wavtokenizer-dec" else "embedding_length"
    n_embd = _uint(metadata, f"{arch}.{embd}")
    key_length = _uint(metadata, f"{arch}.attention.key_length")
    if key_length is None:
        key_length = n_embd // heads[0] if n_embd is not None else None
    n_rot = _uint(metadata, f"{arch}.rope.dimension_count")
    _check_rope(reader, f"{arch}.rope.dimension_count", n_rot, key_length)
    swa_keys = (f"{arch}.attention.key_length_swa", f"{arch}.rope.dimension_count_swa")
    if any(key in metadata for key in swa_keys):
        key_length_swa = _uint(metadata, swa_keys[0])
        n_rot_swa = _uint(metadata, swa_keys[1])
        _check_rope(
            reader,
            swa_keys[1],
            n_rot_swa if n_rot_swa is not None else n_rot if n_rot is not None else key_length,
            key_length_swa if key_length_swa is not None else key_length,
        )


def _check_rope(reader: _Reader, key: str, n_rot: int | None, head_size: int | None) -> None:
    if n_rot is None or head_size is None:
        return
    if n_rot % 2:
        raise reader.fail(f"{key} = {n_rot} must be even")
    if n_rot > head_size:
        raise reader.fail(f"{key} = {n_rot} exceeds the head size (key_length) {head_size}")


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


def _check_hyperparameters(
    reader: _Reader, metadata: dict[str, Any], tensors: list[Any], kind: Kind
) -> None:
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise reader.fail("general.architecture is missing")
    _check_header_types(reader, metadata)
    # llama.cpp reads no hyperparameters for adapters and projectors, nor for a "clip" model
    # (it refuses that one after loading its tensors). general.type is never consulted: the
    # model loader does not read it, so a model claiming to be an adapter is still a model.
    if kind != "model" or arch == "clip":
        return
    _check_generic(reader, arch, metadata)
    n_layer = _check_layers(reader, arch, metadata, tensors)
    if n_layer is not None:  # else llama.cpp refuses the file: block_count is required
        _check_experts(reader, arch, metadata, n_layer)
        _check_heads(reader, arch, metadata, n_layer)
    _check_enums(reader, arch, metadata)
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


def validate_gguf(path: Path, kind: Kind = "model") -> None:
    """Raise ModelLoadError / InvalidModelError unless ``path`` looks safe to hand to llama.cpp.
    For a split model, ``path`` is the first part and every part is checked. ``kind`` is how the
    file will be loaded: as a model (llama_model_load_from_file, whatever its general.type says;
    every hyperparameter check), as a LoRA adapter or as a multimodal projector (header and
    tensors only: their loaders read no model hyperparameters)."""
    reader, metadata, tensors = _read_file(path)
    count = metadata.get("split.count", 1)
    if isinstance(count, int) and count > 1:
        for part in split_parts(path, count)[1:]:
            tensors = tensors + _read_file(part)[2]
    _check_hyperparameters(reader, metadata, tensors, kind)
