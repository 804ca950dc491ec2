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
from llamacrab._native import gguf_archs as archs
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
_TOKENS, _TOKEN_TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"
_MAX_VOCABULARY = 1 << 22  # decoded whole in Python: bounded (real vocabularies are < 1M)
_BYTE_TOKEN = 6  # LLAMA_TOKEN_TYPE_BYTE
_POOLING_TYPES = range(5)  # none, mean, cls, last, rank
_EXPERT_GATING_FUNCS = range(1, 5)  # softmax, sigmoid, softmax_weight, sqrt_softplus
# These archs reset expert_count <= 1 to 0 (and expert_used_count to 0) before the expert asserts.
_EXPERTS_RESET_ARCHS = ("hunyuan-dense", "hunyuan_vl")

Kind = Literal["model", "adapter", "projector"]


@dataclass(frozen=True)
class GgufArray:
    """A metadata array: its item type and length, and its values when they are needed: numeric
    arrays short enough to be per-layer hyperparameters, and the vocabulary arrays (tokens as raw
    bytes). Other arrays keep only their length."""

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

    def _strings(self, count: int) -> tuple[bytes, ...]:
        """``count`` strings as raw bytes (llama.cpp compares tokens byte for byte); the walk in
        C checks first that they lie inside the file."""
        start = self.offset
        self._skip_strings(count)
        data, offset, length = self.data, start, struct.Struct("<Q")
        words = []
        for _ in range(count):
            (size,) = length.unpack_from(data, offset)
            words.append(data[offset + 8 : offset + 8 + size])
            offset += 8 + size
        return tuple(words)

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
                return GgufArray(item_kind, count, self._strings(count))
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


def _check_attention(reader: _Reader, arch: str, metadata: dict[str, Any], n_layer: int) -> None:
    """Attention hyperparameters that pass loading but abort when the context is created or at
    the first decode: heads, sliding-window layers, head sizes, rope dimensions."""
    heads = _check_head_counts(reader, arch, metadata, n_layer)
    swa = _swa_layers(reader, arch, metadata, n_layer)
    if swa is not None:
        _check_swa(reader, arch, metadata, n_layer, swa)
    sizes = _head_sizes(arch, metadata, heads[0])
    if sizes is None or heads[0] == 0:
        return  # llama.cpp reads no head size nor rope dimensions without heads
    full, sliding = sizes
    if f"{arch}.rope.dimension_count" in metadata:
        _check_rope(reader, f"{arch}.rope.dimension_count", full)
    swa_keys = (f"{arch}.attention.key_length_swa", f"{arch}.rope.dimension_count_swa")
    if any(key in metadata for key in swa_keys):
        _check_rope(reader, swa_keys[1], sliding)
    layer0 = sliding if swa is not None and swa[1][0] else full
    _check_head_equality(reader, arch, full, sliding, layer0)
    _check_mrope(reader, arch, metadata, layer0.rope)


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
    """(sliding-window attention on, which layers use it) as llama.cpp sets them; None where it
    refuses the pattern key (a throw: nothing to check)."""
    if arch == "deepseek4" or (
        arch == "dflash" and (_uint(metadata, f"{arch}.hyper_connection.count") or 0) > 0
    ):
        return True, [True] * n_layer
    n_main = n_layer - (_uint(metadata, f"{arch}.nextn_predict_layers") or 0)
    on, spec = _swa_mode(arch, metadata, n_main)
    if not on:
        return False, [False] * n_layer
    key = f"{arch}.attention.sliding_window_pattern"
    value = metadata.get(key)
    if isinstance(value, GgufArray):  # read as is, nextn layers included
        if value.item_kind not in (_UINT32, _INT32, _BOOL) or value.values is None:
            return None
        flags = [v != 0 for v in value.values[:n_layer]]
        return True, flags + [False] * (n_layer - len(flags))
    if spec is None:
        return None  # the arch requires the pattern array
    n_pattern = spec[0] if value is None else _uint(metadata, key)
    if n_pattern is None:
        return None  # not an integer
    return True, _swa_pattern(n_pattern, spec[1], n_main) + [False] * (n_layer - n_main)


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


def _arch_rules(arch: str, metadata: dict[str, Any], n_main: int) -> list[tuple[bool, str]]:
    """GGML_ASSERTs of load_arch_hparams (src/models/<arch>.cpp) on plain keys, as (holds, what
    must hold). A required key that is absent reads as 0: llama.cpp refuses the file anyway."""

    def key(name: str, default: float = 0) -> float:
        value = metadata.get(f"{arch}.{name}", default)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return value if number else default  # other types: llama.cpp throws

    if arch == "gemma-embedding":
        n_embd = key("embedding_length")
        return [
            (key("dense_2_feat_in") in (0, n_embd), "dense_2_feat_in is 0 or embedding_length"),
            (key("dense_3_feat_out") in (0, n_embd), "dense_3_feat_out is 0 or embedding_length"),
        ]
    if arch == "nanbeige":
        loops = key("num_loops", 1)
        return [(loops > 0 and n_main * loops <= LLAMA_MAX_LAYERS, "num_loops x layers in 1..512")]
    if arch == "hrm_text":
        stack, high, low = key("hrm.layers_per_stack"), key("hrm.h_cycles"), key("hrm.l_cycles")
        return [
            (min(stack, high, low) > 0, "hrm.layers_per_stack, h_cycles and l_cycles > 0"),
            (stack * high * (low + 1) == n_main, "layers_per_stack x h_cycles x (l_cycles + 1) "
             "== block_count - nextn_predict_layers"),
        ]  # fmt: skip
    if arch == "minimax-m3":
        return [(key("attention.indexer.block_size") > 0, "attention.indexer.block_size > 0")]
    if arch == "glm5-next":
        kpool, top_k = key("attention.indexer.kpool"), key("attention.indexer.top_k")
        return [
            (kpool > 1 and top_k % kpool == 0, "attention.indexer.kpool > 1, dividing top_k"),
            (key("hyper_connection.count") == 4, "hyper_connection.count == 4"),
        ]
    if arch == "bailingmoe3":
        safe_gate = metadata.get(f"{arch}.kda.safe_gate", True)
        return [(safe_gate is True and key("kda.gate_lower_bound") < 0,
                 "kda.safe_gate true and kda.gate_lower_bound < 0")]  # fmt: skip
    if arch == "dflash" and key("hyper_connection.count") > 0:
        return [(key("attention.output_group_count") > 0 and key("attention.sliding_window") > 0,
                 "attention.output_group_count and attention.sliding_window > 0")]  # fmt: skip
    if arch == "deepseek4":
        ratios = metadata.get(f"{arch}.attention.compress_ratios")
        count = ratios.count if isinstance(ratios, GgufArray) else 0
        return [(count <= LLAMA_MAX_LAYERS, "attention.compress_ratios has at most 512 entries")]
    return []


def _check_arch_rules(reader: _Reader, arch: str, metadata: dict[str, Any], n_layer: int) -> None:
    n_main = n_layer - (_uint(metadata, f"{arch}.nextn_predict_layers") or 0)
    for holds, what in _arch_rules(arch, metadata, n_main):
        if not holds:
            raise reader.fail(f"{arch} needs {what}")


# -- vocabulary and tensors ----------------------------------------------------------------------


def _repeated_token(words: tuple[bytes, ...]) -> bytes | None:
    """The first token equal to an earlier one as llama.cpp stores them: cut at a NUL (it reads
    C strings), an empty one renamed [EMPTY_<index>]."""
    if len(set(words)) == len(words) and b"" not in words and b"\0" not in b"".join(words):
        return None  # the common case, without a loop in Python
    seen: set[bytes] = set()
    for i, word in enumerate(words):
        word = word.split(b"\0", 1)[0] or f"[EMPTY_{i}]".encode()
        if word in seen:
            return word
        seen.add(word)
    return None


def _check_vocabulary(reader: _Reader, metadata: dict[str, Any]) -> None:
    """What llama_vocab::load asserts on (or divides by) while loading the vocabulary."""
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get(_TOKENS)
    if model in ("none", "no_vocab") or not isinstance(tokens, GgufArray):
        return  # no vocabulary is read (the Vocab handle refuses the model), or llama.cpp throws
    if tokens.item_kind != _STRING or tokens.values is None:
        return  # llama.cpp throws
    if not tokens.values:  # the "test" tokenizer divides by the vocabulary size
        raise reader.fail(f"{_TOKENS} is empty")
    repeated = _repeated_token(tokens.values)
    if repeated is not None:
        raise reader.fail(
            f"{_TOKENS} holds {repeated.decode('utf-8', 'replace')!r} twice: llama.cpp needs "
            "distinct tokens"
        )
    types = metadata.get(_TOKEN_TYPES)
    byte_tokens = (
        isinstance(types, GgufArray) and _BYTE_TOKEN in (types.values or ())[: tokens.count]
    )
    if model == "bert" and byte_tokens:  # token_to_byte aborts for WordPiece
        raise reader.fail(
            f"a bert (WordPiece) vocabulary has byte tokens (type 6) in {_TOKEN_TYPES}"
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
        _check_attention(reader, arch, metadata, n_layer)
        _check_arch_rules(reader, arch, metadata, n_layer)
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
