"""Check a GGUF model's attention hyperparameters: head counts and sizes, rope dimensions,
sliding-window layers and M-RoPE sections, which pass loading but abort when the context is
created or at the first decode. kv_layout reads the same head sizes and sliding-window layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llamacrab._native.gguf import archs
from llamacrab._native.gguf_reader import BOOL, INT32, UINT32, GgufArray, Reader, per_layer, uint


def _get(metadata: dict[str, Any], key: str, default: int) -> int:
    value = uint(metadata, key)
    return default if value is None else value


@dataclass(frozen=True)
class HeadSize:
    """The head sizes llama.cpp derives for one kind of layer (full or sliding-window)."""

    key: int
    value: int
    rope: int


def head_sizes(
    arch: str, metadata: dict[str, Any], n_head: int
) -> tuple[HeadSize, HeadSize] | None:
    """(full, sliding-window) head sizes as load_hparams derives them; None without an embedding
    length (llama.cpp then refuses the file)."""
    embd = "features_length" if arch == "wavtokenizer-dec" else "embedding_length"
    n_embd = uint(metadata, f"{arch}.{embd}")
    if n_embd is None:
        return None
    full = HeadSize(0, 0, 0)  # without heads llama.cpp reads none of these keys
    if n_head > 0:
        key = _get(metadata, f"{arch}.attention.key_length", n_embd // n_head)
        value = _get(metadata, f"{arch}.attention.value_length", n_embd // n_head)
        full = HeadSize(key, value, _get(metadata, f"{arch}.rope.dimension_count", key))
    swa = HeadSize(
        _get(metadata, f"{arch}.attention.key_length_swa", full.key),
        _get(metadata, f"{arch}.attention.value_length_swa", full.value),
        _get(metadata, f"{arch}.rope.dimension_count_swa", full.rope),
    )
    return full, swa


def _check_head_counts(
    reader: Reader, arch: str, metadata: dict[str, Any], n_layer: int
) -> list[int]:
    """Per-layer head counts; ggml_mul_mat / flash attention broadcast the KV heads, so they
    must divide the query heads."""
    heads_key, kv_key = f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"
    heads = per_layer(reader, metadata, heads_key, n_layer) or [0] * n_layer
    heads_kv = per_layer(reader, metadata, kv_key, n_layer) or heads
    for il, (n_head, n_head_kv) in enumerate(zip(heads, heads_kv, strict=True)):
        if n_head_kv > 0 and n_head % n_head_kv:
            raise reader.fail(
                f"{heads_key} = {n_head} is not a multiple of {kv_key} = {n_head_kv} (layer {il})"
            )
    per_layer_graph = arch in archs.PER_LAYER_KV_HEADS
    if (
        isinstance(metadata.get(kv_key), GgufArray)
        and not per_layer_graph
        and len(set(heads_kv)) > 1
    ):
        raise reader.fail(
            f"{kv_key} = {heads_kv} differs between layers: {arch}'s graph sizes every "
            "layer's keys by layer 0's count"
        )
    return heads


def check_attention(
    reader: Reader, arch: str, metadata: dict[str, Any], n_layer: int
) -> HeadSize | None:
    """Attention hyperparameters that pass loading but abort when the context is created or at
    the first decode: heads, sliding-window layers, head sizes, rope dimensions. Returns layer
    0's head sizes (None without embedding_length: llama.cpp refuses the file)."""
    heads = _check_head_counts(reader, arch, metadata, n_layer)
    swa = swa_layers(reader, arch, metadata, n_layer)
    if swa is not None:
        _check_swa(reader, arch, metadata, n_layer, swa)
    sizes = head_sizes(arch, metadata, heads[0])
    if sizes is None:
        return None
    full, sliding = sizes
    layer0 = sliding if swa is not None and swa[1][0] else full
    if heads[0] == 0:
        return layer0  # llama.cpp reads no head size nor rope dimensions without heads
    if f"{arch}.rope.dimension_count" in metadata:
        _check_rope(reader, arch, f"{arch}.rope.dimension_count", full)
    swa_keys = (f"{arch}.attention.key_length_swa", f"{arch}.rope.dimension_count_swa")
    if any(key in metadata for key in swa_keys):
        _check_rope(reader, arch, swa_keys[1], sliding)
    _check_head_equality(reader, arch, full, sliding, layer0)
    if swa is not None and arch not in archs.HEADS_BY_LAYER_KIND:
        _check_mixed_kinds(reader, arch, swa[1], full, sliding)
    _check_mrope(reader, arch, metadata, layer0.rope)
    return layer0


def _check_mixed_kinds(
    reader: Reader, arch: str, sliding_layers: list[bool], full: HeadSize, sliding: HeadSize
) -> None:
    """Where sliding-window and full-attention layers mix, their head sizes agree: the KV cache
    sizes each layer's by its kind, and a graph (all but archs.HEADS_BY_LAYER_KIND) all of
    them by layer 0's."""
    if len(set(sliding_layers)) > 1 and (full.key, full.value) != (sliding.key, sliding.value):
        raise reader.fail(
            f"{arch} sizes every layer's heads by layer 0's, and its layers mix sliding-window "
            f"and full attention: attention.key_length_swa and value_length_swa "
            f"({sliding.key}, {sliding.value}) must equal key_length and value_length "
            f"({full.key}, {full.value})"
        )


def _check_rope(reader: Reader, arch: str, key: str, size: HeadSize) -> None:
    """The rope kernel asserts n_dims <= head size and n_dims even, never ends over 0
    dimensions of a whole head (archs.ROPE_WHOLE_HEAD) and reads and writes past an odd head
    it ropes in part; step35 halves its full layers' value before the kernel sees it."""
    if size.rope % 2:
        raise reader.fail(f"{key} = {size.rope} must be even")
    if size.rope == 0 and arch in archs.ROPE_WHOLE_HEAD:
        raise reader.fail(
            f"{key} = 0: {arch} ropes whole heads, and ggml's rope kernel never ends over 0 "
            "dimensions"
        )
    if arch == "step35" and key.endswith(".rope.dimension_count") and size.rope % 4:
        raise reader.fail(f"{key} = {size.rope} must be a multiple of 4 (step35 halves it)")
    if size.rope > size.key:
        raise reader.fail(f"{key} = {size.rope} exceeds the head size (key_length) {size.key}")
    if size.rope < size.key and size.key % 2:
        raise reader.fail(
            f"{key} = {size.rope} with an odd head size (key_length) {size.key}: ggml's rope "
            "kernel copies the channels it does not rotate two at a time, one past each row"
        )


def _check_head_equality(
    reader: Reader, arch: str, full: HeadSize, sliding: HeadSize, layer0: HeadSize
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
    if arch in archs.HEADS_ALL_ROPE:
        sizes = {full.key, full.value, full.rope, sliding.key, sliding.value, sliding.rope}
        if len(sizes) > 1:
            raise reader.fail(
                f"{arch} needs key_length, value_length and their _swa values equal to "
                f"rope.dimension_count (its heads are that wide), got {sorted(sizes)}"
            )
    if arch in archs.HEADS_K_EQ_V_EQ_ROT and layer0.rope != layer0.key:
        raise reader.fail(
            f"{arch} needs rope.dimension_count == attention.key_length (after defaults), "
            f"got {layer0.rope} and {layer0.key}"
        )


# -- sliding-window layers ----------------------------------------------------------------------


def _swa_mode(arch: str, metadata: dict[str, Any], n_main: int) -> tuple[bool, archs.SwaPattern]:
    """Whether load_arch_hparams turns sliding-window attention on, and the pattern it reads."""
    window = uint(metadata, f"{arch}.attention.sliding_window")
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


def swa_layers(
    reader: Reader, arch: str, metadata: dict[str, Any], n_layer: int
) -> tuple[bool, list[bool]] | None:
    """(sliding-window attention on for create_memory, which layers use it) as llama.cpp sets
    them; None where it refuses the pattern key (a throw: nothing to check)."""
    if arch == "deepseek4" or (
        arch == "dflash" and (uint(metadata, f"{arch}.hyper_connection.count") or 0) > 0
    ):
        return True, [True] * n_layer
    key = f"{arch}.attention.sliding_window_pattern"
    value = metadata.get(key)
    if arch in archs.SWA_OWN_MEMORY:  # on for the graph, but no generic create_memory assert
        flags = _pattern_flags(value, n_layer)
        return None if flags is None else (False, flags)
    n_main = n_layer - (uint(metadata, f"{arch}.nextn_predict_layers") or 0)
    on, spec = _swa_mode(arch, metadata, n_main)
    if not on:
        return False, [False] * n_layer
    if isinstance(value, GgufArray):
        flags = _pattern_flags(value, n_layer)
        return None if flags is None else (True, flags)
    if spec is None:
        return None  # the arch requires the pattern array
    n_pattern = spec[0] if value is None else uint(metadata, key)
    if n_pattern is None:
        return None  # not an integer
    return True, _swa_pattern(n_pattern, spec[1], n_main) + [False] * (n_layer - n_main)


def _pattern_flags(value: Any, n_layer: int) -> list[bool] | None:
    """A sliding_window_pattern array read as is (nextn layers included, missing entries
    false); None where llama.cpp refuses it (a throw)."""
    if not isinstance(value, GgufArray):
        return None
    if value.item_kind not in (UINT32, INT32, BOOL) or value.values is None:
        return None
    flags = [v != 0 for v in value.values[:n_layer]]
    return flags + [False] * (n_layer - len(flags))


def _check_swa(
    reader: Reader,
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
        shared = uint(metadata, f"{arch}.attention.shared_kv_layers") or 0
        if n_layer - shared < 2:
            raise reader.fail(
                f"{arch}.attention.shared_kv_layers = {shared} leaves {n_layer - shared} of "
                f"{n_layer} layers with a KV cache of their own: llama.cpp needs at least 2"
            )
        _check_kv_reuse(reader, arch, metadata, flags, n_layer - shared)


def _require_layer(reader: Reader, arch: str, flags: list[bool], sliding: bool) -> None:
    if sliding not in flags:
        kind = "sliding-window" if sliding else "full-attention"
        raise reader.fail(
            f"{arch}.attention.sliding_window_pattern makes no layer {kind}, but {arch} with "
            "sliding-window attention needs one"
        )


def _check_kv_reuse(
    reader: Reader, arch: str, metadata: dict[str, Any], flags: list[bool], start: int
) -> None:
    """Layers from ``start`` on reuse the KV cache of layer start-1 (full attention) or start-2
    (sliding-window): llama_kv_cache asserts that layer is of the same kind."""
    n_main = len(flags) - (uint(metadata, f"{arch}.nextn_predict_layers") or 0)
    later = flags[start:n_main]
    for sliding, source in ((False, start - 1), (True, start - 2)):
        if sliding in later and flags[source] != sliding:
            kind = "sliding-window" if sliding else "full-attention"
            raise reader.fail(
                f"{arch}: the {kind} layers from {start} on reuse the KV cache of layer "
                f"{source}, which {arch}.attention.sliding_window_pattern does not make {kind}"
            )


# -- M-RoPE -------------------------------------------------------------------------------------


def _sections(reader: Reader, metadata: dict[str, Any], key: str) -> list[int] | None:
    """The four int32 M-RoPE sections llama.cpp reads (zeros when absent); None where it refuses
    the key's type or length (a throw)."""
    value = metadata.get(key)
    if value is None:
        return [0] * 4
    if isinstance(value, GgufArray):
        if value.item_kind not in (UINT32, INT32, BOOL) or value.count != 4:
            return None
        assert value.values is not None
        return [v - (1 << 32) if v >= 1 << 31 else int(v) for v in value.values]
    return [value] * 4 if reader.types[key] == INT32 else None


def _check_mrope(reader: Reader, arch: str, metadata: dict[str, Any], n_rot: int) -> None:
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
