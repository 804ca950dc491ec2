"""Validate a GGUF file's header before llama.cpp sees it.

llama.cpp rejects most malformed files cleanly, but some tampered values reach a GGML_ASSERT and
abort the whole process (a block_count that disagrees with the blk.N tensors, a non-positive norm
epsilon, ...). Everything that can be checked from the header is checked before loading, so such
files raise InvalidModelError instead: the generic checks here, the rest in attention,
arch_rules and vocab_check. docs/native-aborts.md lists the asserts and which check
covers each.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from llamacrab._native.gguf.arch_rules import check_arch_rules
from llamacrab._native.gguf.attention import check_attention
from llamacrab._native.gguf.overrides import overridden
from llamacrab._native.gguf.vocab_check import check_vocabulary
from llamacrab._native.gguf_reader import (
    FLOAT32,
    LLAMA_MAX_LAYERS,
    Reader,
    per_layer,
    read_file,
    split_parts,
    uint,
)
from llamacrab_sys import lib

# llama.cpp limits (src/llama-hparams.h) and enums (include/llama.h, src/llama-hparams.h).
LLAMA_MAX_EXPERTS = 1024
_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
_POOLING_TYPES = range(5)  # none, mean, cls, last, rank
_EXPERT_GATING_FUNCS = range(1, 5)  # softmax, sigmoid, softmax_weight, sqrt_softplus
# The values enum llama_ftype can hold (its largest, LLAMA_FTYPE_GUESSED, is 1024): the loader
# casts general.file_type to it, and a value past them is undefined behaviour (UBSan: "not a
# valid value for type 'llama_ftype'").
_FILE_TYPES = range(2048)
# These archs reset expert_count <= 1 to 0 (and expert_used_count to 0) before the expert asserts.
_EXPERTS_RESET_ARCHS = ("hunyuan-dense", "hunyuan_vl")

Kind = Literal["model", "adapter", "projector"]


def _check_header_types(reader: Reader, metadata: dict[str, Any]) -> None:
    """Keys that llama_adapter_lora_init reads with gguf_get_val_str / _f32, which assert the
    type (an abort) instead of checking it. Adapters and models alike: the GGUF spec types them."""
    for key in ("general.type", "adapter.type"):
        if key in metadata and not isinstance(metadata[key], str):
            raise reader.fail(f"{key} = {metadata[key]!r} must be a string")
    alpha = "adapter.lora.alpha"
    if alpha in metadata and reader.types[alpha] != FLOAT32:
        raise reader.fail(f"{alpha} = {metadata[alpha]!r} must be a float32")


def _check_generic(reader: Reader, arch: str, metadata: dict[str, Any]) -> None:
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
        if isinstance(value, float):
            _check_float(reader, key, value)


# The rotary attention factor scales queries and keys alike (real models: about 1): past this
# the keys overflow a float16 KV cache.
MAX_ROPE_ATTN_FACTOR = 100.0


def _check_float(reader: Reader, key: str, value: float) -> None:
    """A hyperparameter that is not finite (a logit softcap, a scale), a rotary frequency base
    of 0 or less, or a huge rotary attention factor turns every logit into NaN: a model that
    loads and never decodes."""
    base = key.endswith(("rope.freq_base", "rope.freq_base_swa"))
    if not math.isfinite(value) or (base and value <= 0):
        raise reader.fail(f"{key} = {value} must be a finite number{' above 0' * base}")
    if key.endswith("rope.scaling.attn_factor") and abs(value) > MAX_ROPE_ATTN_FACTOR:
        raise reader.fail(f"{key} = {value} must be within ±{MAX_ROPE_ATTN_FACTOR:g}")


def _check_layers(
    reader: Reader, arch: str, metadata: dict[str, Any], tensors: list[Any]
) -> int | None:
    """block_count (None when absent: llama.cpp then refuses the file) and the counts bounded
    by it (llama-model.cpp: n_layer_all, n_layer_nextn, wavtokenizer posnet/convnext)."""
    key = f"{arch}.block_count"
    block_count = uint(metadata, key)
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
        value = uint(metadata, f"{arch}.{name}")
        if value is not None and value > block_count:
            raise reader.fail(f"{arch}.{name} = {value} exceeds {key} = {block_count}")
    return block_count


def _check_experts(reader: Reader, arch: str, metadata: dict[str, Any], n_layer: int) -> None:
    """The expert asserts of llama-model.cpp (load_hparams, after the expert keys are read)."""
    count_key, used_key = f"{arch}.expert_count", f"{arch}.expert_used_count"
    groups_key, group_used_key = f"{arch}.expert_group_count", f"{arch}.expert_group_used_count"
    n_expert = uint(metadata, count_key) or 0
    used_max = max(per_layer(reader, metadata, used_key, n_layer), default=0)
    groups = uint(metadata, groups_key) or 0
    group_used = uint(metadata, group_used_key) or 0
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


def _check_tied_output(reader: Reader, tensors: list[Any]) -> None:
    """llama-model.cpp asserts that an NVFP4 output tied to token_embd.weight (no output.weight)
    comes without the scale tensors of a separate output head."""
    types = {name: ggml_type for name, _, ggml_type, _ in tensors}
    scales = sorted({"output.scale", "output.input_scale"} & types.keys())
    tied = "output.weight" not in types
    if tied and scales and types.get("token_embd.weight") == lib.GGML_TYPE_NVFP4:
        raise reader.fail(
            f"token_embd.weight (NVFP4) doubles as the output, which cannot have {scales[0]}"
        )


def _check_enums(reader: Reader, arch: str, metadata: dict[str, Any]) -> None:
    key = f"{arch}.rope.scaling.type"
    if key in metadata and metadata[key] not in _ROPE_SCALING_TYPES:
        raise reader.fail(
            f"{key} = {metadata[key]!r} is not one of {', '.join(_ROPE_SCALING_TYPES)}"
        )
    for key, allowed in (
        (f"{arch}.pooling_type", _POOLING_TYPES),
        (f"{arch}.classifier.pooling_type", _POOLING_TYPES),
        (f"{arch}.expert_gating_func", _EXPERT_GATING_FUNCS),
        ("general.file_type", _FILE_TYPES),
    ):
        value = uint(metadata, key)
        if value is not None and value not in allowed:
            what = f"{allowed.start}..{allowed.stop - 1}"
            raise reader.fail(f"{key} = {value} is out of range {what}")


def _check_projector_epsilons(reader: Reader, metadata: dict[str, Any]) -> None:
    """libmtmd passes its layer norms' epsilons to ggml as they are, and ggml's norm asserts
    (aborts) on a negative or NaN one when the first image or sound is encoded."""
    for key, value in metadata.items():
        epsilon = key.startswith("clip.") and "epsilon" in key and isinstance(value, float)
        if epsilon and not (value > 0 and math.isfinite(value)):
            raise reader.fail(f"{key} = {value} must be a positive finite number")


def _check_hyperparameters(
    reader: Reader, metadata: dict[str, Any], tensors: list[Any], kind: Kind
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
        layer0 = check_attention(reader, arch, metadata, n_layer)
        check_arch_rules(reader, arch, metadata, tensors, n_layer, layer0)
    _check_enums(reader, arch, metadata)
    check_vocabulary(reader, metadata)
    _check_tied_output(reader, tensors)
    n_embd = metadata.get(f"{arch}.embedding_length")
    embeddings = [t for t in tensors if t[0] == "token_embd.weight"]
    if embeddings and isinstance(n_embd, int) and embeddings[0][1][0] != n_embd:
        raise reader.fail(
            f"token_embd.weight has rows of {embeddings[0][1][0]}, "
            f"{arch}.embedding_length is {n_embd}"
        )


_POSITION_TABLE = "position_embd.weight"  # llama.cpp's LLM_TENSOR_POS_EMBD
# A classification head's last layer: LLM_TENSOR_CLS_OUT, else LLM_TENSOR_CLS (jina-bert-v2's
# one-output head), each {n_embd, outputs}.
_CLASSIFIER_LAYERS = ("cls.output.weight", "cls.weight")


def validate_gguf(
    path: Path, kind: Kind = "model", overrides: Mapping[str, int | float | str] | None = None
) -> tuple[Reader, dict[str, Any]]:
    """Raise ModelLoadError / InvalidModelError unless ``path`` looks safe to hand to llama.cpp.
    For a split model, ``path`` is the first part and every part is checked. ``kind`` is how the
    file will be loaded: as a model (llama_model_load_from_file, whatever its general.type says;
    every hyperparameter check), as a LoRA adapter (header and tensors only: its loader reads
    no model hyperparameters) or as a multimodal projector (header, tensors and the epsilons
    ggml asserts on; the rest is tried in a child process: ``projector_probe``). A model's
    ``overrides`` (``kv_overrides``) are checked as the values llama.cpp will read. Returns the
    first part's header as llama.cpp will read it (the overrides applied)."""
    reader, metadata, tensors = read_file(path)
    count = metadata.get("split.count", 1)
    if isinstance(count, int) and count > 1:
        for part in split_parts(path, count)[1:]:
            tensors = tensors + read_file(part)[2]
    _check_hyperparameters(reader, metadata, tensors, kind)
    reader.position_rows = next(
        (int(dims[1]) for name, dims, _, _ in tensors if name == _POSITION_TABLE and len(dims) > 1),
        None,
    )
    shapes = {name: dims for name, dims, _, _ in tensors if name in _CLASSIFIER_LAYERS}
    last = next((shapes[name] for name in _CLASSIFIER_LAYERS if name in shapes), None)
    reader.classifier_rows = None if last is None else int(last[1]) if len(last) > 1 else 1
    if overrides and kind == "model":
        reader, metadata = overridden(reader, metadata, overrides)
        _check_hyperparameters(reader, metadata, tensors, kind)
    return reader, metadata
