"""validate_gguf rejects the header values that reach a GGML_ASSERT in llama.cpp (the NEEDS CHECK
rows of docs/native-aborts.md), and still accepts real files.

Most cases write a header-only GGUF (metadata, no tensors) and call validate_gguf directly; a few
load a tiny model with a bad value through Llama, in a child process, to show the process survives
with the check and, for the asserts this file names, dies without it (a tripwire for the weekly
llama.cpp bump: if an unchecked load stops aborting, re-audit that row).
"""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from llamacrab import InvalidModelError, InvalidParameterError, Llama, ModelLoadError
from llamacrab._native import gguf_reader
from llamacrab._native.gguf.check import LLAMA_MAX_EXPERTS, validate_gguf
from llamacrab._native.gguf_reader import LLAMA_MAX_LAYERS

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")

VT = gguf.GGUFValueType
MOE = {"expert_count": 8, "expert_used_count": 2}
BASE = {
    "block_count": 2,
    "embedding_length": 64,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
}


def add(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """Add (or overwrite) a key; a tuple ``(value, GGUFValueType)`` forces the type."""
    if isinstance(value, tuple):
        value, vtype = value
    elif isinstance(value, str):
        vtype = VT.STRING
    elif isinstance(value, float):
        vtype = VT.FLOAT32
    elif isinstance(value, bool):
        vtype = VT.BOOL
    elif isinstance(value, list):
        writer.add_array(key, value)
        return
    else:
        vtype = VT.UINT32
    writer.add_key_value(key, value, vtype)


def full_key(arch: str, key: str) -> str:
    return key if key.startswith(("general.", "adapter.", "tokenizer.")) else f"{arch}.{key}"


def header(
    path: Path, keys: dict[str, Any], arch: str = "llama", tensors: dict[str, Any] | None = None
) -> Path:
    """A GGUF with BASE plus ``keys`` (``{arch}.`` prefixed; None removes a BASE key), and no
    tensors unless given (name: array, or (raw bytes array, GGML type))."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {**BASE, **keys}.items():
        if value is not None:
            add(writer, full_key(arch, key), value)
    for name, data in (tensors or {}).items():
        if isinstance(data, tuple):
            writer.add_tensor(name, data[0], raw_dtype=data[1])
        else:
            writer.add_tensor(name, data)
    tiny.write_gguf(writer, {})
    return path


def weights(*shape: int) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(shape) * 0.02).astype(np.float32)


def gemma_norms() -> dict[str, np.ndarray]:
    """The extra tensors of a gemma3 (or gemma-embedding) block over the tiny llama's."""
    head = tiny.N_EMBD // tiny.N_HEAD
    widths = {"attn_q_norm": head, "attn_k_norm": head, "post_attention_norm": tiny.N_EMBD,
              "post_ffw_norm": tiny.N_EMBD}  # fmt: skip
    return {
        f"blk.{i}.{name}.weight": np.ones(width, np.float32)
        for i in range(tiny.N_LAYER)
        for name, width in widths.items()
    }


def qkv_biases() -> dict[str, np.ndarray]:
    """The attention biases qwen2vl requires over the tiny llama's tensors."""
    kv = tiny.N_HEAD_KV * tiny.N_EMBD // tiny.N_HEAD
    return {
        f"blk.{i}.attn_{part}.bias": np.zeros(width, np.float32)
        for i in range(tiny.N_LAYER)
        for part, width in (("q", tiny.N_EMBD), ("k", kv), ("v", kv))
    }


def tiny_model(
    path: Path,
    keys: dict[str, Any],
    arch: str = "llama",
    tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """The tiny llama model (as ``arch``) with ``keys`` and ``tensors`` added or overwritten."""
    writer = gguf.GGUFWriter(str(path), arch)
    tiny._metadata(writer, tiny.N_LAYER, 1e-5)
    for key, value in keys.items():
        add(writer, full_key(arch, key), value)
    all_tensors = tiny._tensors(0, len(tiny.vocabulary()[0])) | (tensors or {})
    tiny.write_gguf(writer, all_tensors)
    return path


def rejects(path: Path, *fragments: str, kind: Any = "model") -> None:
    with pytest.raises(InvalidModelError) as caught:
        validate_gguf(path, kind)
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)


# -- real files ------------------------------------------------------------------------------


def test_the_tiny_model_and_gemma_validate(tiny_model_path: Path, gemma_path: Path) -> None:
    validate_gguf(tiny_model_path)
    validate_gguf(gemma_path)


def test_the_tiny_lora_validates_as_an_adapter_and_as_a_model(tmp_path: Path) -> None:
    lora = tiny.write_tiny_lora(tmp_path / "lora.gguf")
    validate_gguf(lora, "adapter")
    validate_gguf(lora)  # callers that do not say "adapter" yet: no hyperparameters, no checks


def test_the_base_header_validates(tmp_path: Path) -> None:
    validate_gguf(header(tmp_path / "base.gguf", {}))


# -- general.type ----------------------------------------------------------------------------


@pytest.mark.parametrize("general_type", ["adapter", "mmproj", "imatrix"])
def test_general_type_does_not_skip_the_model_checks(tmp_path: Path, general_type: str) -> None:
    path = header(tmp_path / "m.gguf", {"general.type": general_type, "rope.scaling.type": "bogus"})
    rejects(path, "llama.rope.scaling.type", "'bogus'")
    validate_gguf(path, "adapter")  # the adapter loader reads no hyperparameters


def test_header_types_read_without_a_type_check_are_checked(tmp_path: Path) -> None:
    # llama_adapter_lora_init reads these with gguf_get_val_str/_f32, which assert the type.
    rejects(header(tmp_path / "a.gguf", {"general.type": 7}), "general.type", "string")
    rejects(header(tmp_path / "b.gguf", {"adapter.type": 1}), "adapter.type", "string")
    path = header(tmp_path / "c.gguf", {"adapter.lora.alpha": (8.0, VT.FLOAT64)})
    rejects(path, "adapter.lora.alpha", "float32", kind="adapter")


# -- block counts ----------------------------------------------------------------------------


def test_block_count_above_llama_max_layers_is_rejected_without_blk_tensors(
    tmp_path: Path,
) -> None:
    path = header(tmp_path / "m.gguf", {"block_count": LLAMA_MAX_LAYERS + 1})
    rejects(path, "llama.block_count = 513", "1..512")
    validate_gguf(header(tmp_path / "ok.gguf", {"block_count": LLAMA_MAX_LAYERS}))


def test_block_count_above_the_limit_is_rejected_with_blk_tensors(tmp_path: Path) -> None:
    path = tiny_model(tmp_path / "m.gguf", {"block_count": 600, "general.type": "adapter"})
    rejects(path, "llama.block_count = 600", "1..512")


def test_leading_dense_block_count_may_be_zero(tmp_path: Path) -> None:
    validate_gguf(header(tmp_path / "m.gguf", {"leading_dense_block_count": 0}))
    rejects(header(tmp_path / "z.gguf", {"block_count": 0}), "llama.block_count = 0")


def test_nextn_predict_layers_at_most_block_count(tmp_path: Path) -> None:
    validate_gguf(header(tmp_path / "ok.gguf", {"nextn_predict_layers": 2}))
    path = header(tmp_path / "m.gguf", {"nextn_predict_layers": 3})
    rejects(path, "llama.nextn_predict_layers = 3", "llama.block_count = 2")


def test_wavtokenizer_layer_counts_at_most_block_count(tmp_path: Path) -> None:
    path = header(tmp_path / "m.gguf", {"posnet.block_count": 3}, arch="wavtokenizer-dec")
    rejects(path, "wavtokenizer-dec.posnet.block_count = 3")


# -- enums -----------------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", ["none", "linear", "yarn", "longrope"])
def test_known_rope_scaling_types_validate(tmp_path: Path, scaling: str) -> None:
    validate_gguf(header(tmp_path / "m.gguf", {"rope.scaling.type": scaling}))


@pytest.mark.parametrize("scaling", ["bogus", "", "YARN", 2])
def test_unknown_rope_scaling_types_are_rejected(tmp_path: Path, scaling: Any) -> None:
    path = header(tmp_path / "m.gguf", {"rope.scaling.type": scaling})
    rejects(path, "llama.rope.scaling.type", "none, linear, yarn, longrope")


@pytest.mark.parametrize("name", ["pooling_type", "classifier.pooling_type"])
def test_pooling_types(tmp_path: Path, name: str) -> None:
    validate_gguf(header(tmp_path / "ok.gguf", {name: 4}))
    rejects(header(tmp_path / "m.gguf", {name: 5}), f"llama.{name} = 5", "0..4")


@pytest.mark.parametrize("value", [0, 5, 1000])
def test_expert_gating_func_out_of_range(tmp_path: Path, value: int) -> None:
    path = header(tmp_path / "m.gguf", {"expert_gating_func": value})
    rejects(path, f"llama.expert_gating_func = {value}", "1..4")


@pytest.mark.parametrize("value", [2048, 2**31 - 1, 2**32 - 1])
def test_file_types_past_what_llama_ftype_holds_are_rejected(tmp_path: Path, value: int) -> None:
    # The loader casts general.file_type to enum llama_ftype, which holds 0..2047; UBSan stopped
    # a load of 4294967295 ("not a valid value for type 'llama_ftype'").
    validate_gguf(header(tmp_path / "ok.gguf", {"general.file_type": 2047}))
    rejects(header(tmp_path / "m.gguf", {"general.file_type": value}),
            f"general.file_type = {value}", "0..2047")  # fmt: skip


def test_expert_gating_func_in_range(tmp_path: Path) -> None:
    for value in (1, 2, 3, 4):
        validate_gguf(header(tmp_path / f"{value}.gguf", {"expert_gating_func": value}))


# -- experts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "keys",
    [
        {"expert_count": 8, "expert_used_count": 2},
        {"expert_count": 8, "expert_used_count": [2, 2]},
        {**MOE, "expert_group_count": 4, "expert_group_used_count": 2},
        {"expert_count": 8, "expert_used_count": 2, "expert_group_count": 1},
        {"expert_count": LLAMA_MAX_EXPERTS, "expert_used_count": 8},
        {"expert_count": 0, "expert_used_count": 0},
    ],
)
def test_consistent_experts_validate(tmp_path: Path, keys: dict[str, Any]) -> None:
    validate_gguf(header(tmp_path / "m.gguf", keys))


@pytest.mark.parametrize(
    ("keys", "fragments"),
    [
        ({"expert_count": 2000, "expert_used_count": 2}, ["llama.expert_count = 2000", "1024"]),
        ({"expert_count": 4, "expert_used_count": 8}, ["llama.expert_used_count = 8", "= 4"]),
        ({"expert_count": 4, "expert_used_count": [2, 5]}, ["llama.expert_used_count = 5"]),
        ({"expert_used_count": 2}, ["llama.expert_used_count = 2", "llama.expert_count = 0"]),
        ({"expert_count": 4}, ["llama.expert_count = 4", "llama.expert_used_count > 0"]),
        ({"expert_count": 4, "expert_used_count": 0}, ["llama.expert_used_count > 0"]),
        ({"expert_count": 4, "expert_used_count": [0, 0]}, ["llama.expert_used_count > 0"]),
        ({"expert_group_count": 2}, ["llama.expert_group_count = 2", "expert_count > 0"]),
        (
            {"expert_count": 8, "expert_used_count": 2, "expert_group_count": 8},
            ["llama.expert_group_count = 8", "below llama.expert_count = 8"],
        ),
        (
            {**MOE, "expert_group_count": 3, "expert_group_used_count": 1},
            ["llama.expert_count = 8", "multiple of llama.expert_group_count = 3"],
        ),
        (
            {"expert_count": 8, "expert_used_count": 2, "expert_group_count": 4},
            ["llama.expert_group_used_count = 0", "1..3"],
        ),
        (
            {**MOE, "expert_group_count": 4, "expert_group_used_count": 4},
            ["llama.expert_group_used_count = 4", "1..3"],
        ),
        ({"expert_count": 8, "expert_used_count": [2, 2, 2]}, ["3 entries", "block_count is 2"]),
    ],
)
def test_inconsistent_experts_are_rejected(
    tmp_path: Path, keys: dict[str, Any], fragments: list[str]
) -> None:
    rejects(header(tmp_path / "m.gguf", keys), *fragments)


@pytest.mark.parametrize("arch", ["hunyuan-dense", "hunyuan_vl"])
def test_hunyuan_dense_resets_a_single_expert(tmp_path: Path, arch: str) -> None:
    # llama.cpp sets expert_count <= 1 (and the used counts) to 0 for these before asserting.
    validate_gguf(header(tmp_path / "a.gguf", {"expert_count": 1}, arch=arch))
    validate_gguf(header(tmp_path / "b.gguf", {"expert_count": 1, "expert_used_count": 4}, arch))
    path = header(tmp_path / "c.gguf", {"expert_count": 1, "expert_group_count": 1}, arch)
    rejects(path, f"{arch}.expert_group_count = 1")
    rejects(header(tmp_path / "d.gguf", {"expert_count": 1}), "llama.expert_used_count > 0")


# -- heads and rope --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "fragments"),
    [
        ({"attention.head_count_kv": 3}, ["head_count = 4", "head_count_kv = 3", "layer 0"]),
        ({"attention.head_count_kv": 8}, ["head_count_kv = 8"]),
        ({"attention.head_count_kv": [2, 3]}, ["head_count_kv = 3", "layer 1"]),
        ({"attention.head_count": [4, 6], "attention.head_count_kv": 4}, ["head_count = 6"]),
        ({"rope.dimension_count": 15}, ["llama.rope.dimension_count = 15", "even"]),
        ({"rope.dimension_count": 32}, ["llama.rope.dimension_count = 32", "head size", "16"]),
        (
            {"attention.key_length": 8, "rope.dimension_count": 16},
            ["llama.rope.dimension_count = 16", "8"],
        ),
        (
            {"attention.key_length_swa": 8, "rope.dimension_count_swa": 16},
            ["llama.rope.dimension_count_swa = 16", "8"],
        ),
        ({"rope.dimension_count_swa": 7}, ["llama.rope.dimension_count_swa = 7", "even"]),
        # (ggml's rope copies the unrotated channels in pairs: one past an odd head)
        (
            {"attention.key_length": 33, "attention.value_length": 33, "rope.dimension_count": 16},
            ["llama.rope.dimension_count = 16", "odd head size (key_length) 33"],
        ),
        (
            {"attention.key_length_swa": 17, "rope.dimension_count_swa": 8},
            ["llama.rope.dimension_count_swa = 8", "odd head size (key_length) 17"],
        ),
        # llama's graph sizes every layer's keys by layer 0's KV heads (a hybrid's does not)
        ({"attention.head_count_kv": [2, 1]}, ["head_count_kv = [2, 1] differs between layers"]),
        ({"attention.head_count_kv": [2, 0]}, ["head_count_kv = [2, 0] differs between layers"]),
        ({**MOE, "expert_used_count": [1, 2]}, ["expert_used_count the same on every layer"]),
    ],
)
def test_bad_heads_and_rope_dimensions_are_rejected(
    tmp_path: Path, keys: dict[str, Any], fragments: list[str]
) -> None:
    rejects(header(tmp_path / "m.gguf", keys), *fragments)


@pytest.mark.parametrize(
    "keys",
    [
        {"attention.head_count_kv": [2, 2]},
        {"attention.head_count_kv": None},  # defaults to head_count
        {"rope.dimension_count": 16},
        {"attention.key_length": 32, "attention.value_length": 32, "rope.dimension_count": 32},
        {"attention.head_count": 0, "rope.dimension_count": 33},  # no heads: never read
    ],
)
def test_good_heads_and_rope_dimensions_validate(tmp_path: Path, keys: dict[str, Any]) -> None:
    validate_gguf(header(tmp_path / "m.gguf", keys))


def test_partial_rotary_validates_where_the_graph_allows_it(tmp_path: Path) -> None:
    validate_gguf(header(tmp_path / "phi2.gguf", {"rope.dimension_count": 8}, arch="phi2"))
    path = header(tmp_path / "llama.gguf", {"rope.dimension_count": 8})
    rejects(path, "llama needs rope.dimension_count == attention.key_length", "got 8 and 16")


@pytest.mark.parametrize(
    ("arch", "keys"),
    [
        ("llama", {"attention.value_length": 8}),
        ("phi2", {"attention.value_length": 8}),
        ("gemma4", {"attention.sliding_window_pattern": [1, 0], "attention.value_length": 8}),
        # granite_swa's layer 0 is sliding-window: its sizes are the _swa ones
        ("granite_swa", {"attention.sliding_window_pattern": [1, 0],
                         "attention.key_length_swa": 8, "rope.dimension_count_swa": 8}),
    ],
)  # fmt: skip
def test_graphs_that_need_equal_key_and_value_heads_are_protected(
    tmp_path: Path, arch: str, keys: dict[str, Any]
) -> None:
    rejects(header(tmp_path / "m.gguf", keys, arch), f"{arch} needs attention.value_length")


@pytest.mark.parametrize(
    ("arch", "keys"),
    [
        ("gemma3", {"attention.value_length": 8}),  # its graph uses both sizes
        ("gemma4", {"attention.sliding_window_pattern": [1, 0], "attention.key_length_swa": 8,
                    "attention.value_length_swa": 8, "rope.dimension_count_swa": 8}),  # by kind
        ("granite_swa", {"attention.sliding_window_pattern": [1, 1], "attention.key_length_swa": 8,
                         "attention.value_length_swa": 8, "rope.dimension_count_swa": 8}),
    ],
)  # fmt: skip
def test_head_sizes_llama_cpp_accepts_validate(
    tmp_path: Path, arch: str, keys: dict[str, Any]
) -> None:
    validate_gguf(header(tmp_path / "m.gguf", keys, arch))


@pytest.mark.parametrize(
    "keys",
    [
        {"attention.sliding_window_pattern": [1, 0], "attention.key_length_swa": 8,
         "attention.value_length_swa": 8, "rope.dimension_count_swa": 8},
        {"attention.sliding_window_pattern": [0, 1], "attention.key_length_swa": 8,
         "rope.dimension_count_swa": 8},  # layer 0 is full attention
    ],
)  # fmt: skip
def test_mixed_layers_with_other_sliding_window_heads_are_refused(
    tmp_path: Path, keys: dict[str, Any]
) -> None:
    """granite_swa sizes every layer's heads by layer 0's, and its KV cache each layer's by its
    kind: both files aborted when a context was made (GGML_ASSERT(a->ne[0] == b->ne[0]) in
    ggml_set_rows, synthesized and run with the checks off)."""
    rejects(
        header(tmp_path / "m.gguf", keys, "granite_swa"), "sizes every layer's heads by layer 0's"
    )


# -- sliding-window layers -------------------------------------------------------------------

WINDOW = {"attention.sliding_window": 16}
PATTERN = "attention.sliding_window_pattern"


@pytest.mark.parametrize(
    ("arch", "keys", "kind"),
    [
        ("gemma3", {**WINDOW, PATTERN: 1}, "sliding-window"),
        ("gemma3", {**WINDOW, PATTERN: [0, 0]}, "sliding-window"),
        ("gemma4", {PATTERN: [False, False, True]}, "sliding-window"),  # past block_count
        ("gemma2", {PATTERN: 1}, "sliding-window"),
        ("cohere2moe", {"block_count": 1}, "sliding-window"),  # its first layer is full
        ("exaone4", {"block_count": 64, PATTERN: 1}, "sliding-window"),
        ("llama4", {PATTERN: 1}, "sliding-window"),
        ("gemma-embedding", {PATTERN: 1}, "sliding-window"),
        ("gemma-embedding", {PATTERN: 0}, "full-attention"),  # no KV cache: both masks used
    ],
)
def test_a_sliding_window_model_without_such_layers_is_rejected(
    tmp_path: Path, arch: str, keys: dict[str, Any], kind: str
) -> None:
    rejects(header(tmp_path / "m.gguf", keys, arch), f"{arch}.{PATTERN}", f"no layer {kind}")


@pytest.mark.parametrize(
    ("arch", "keys"),
    [
        ("gemma3", WINDOW),
        ("gemma3", {PATTERN: 1}),  # no window: no sliding-window attention
        ("gemma3", {"attention.sliding_window": 0, PATTERN: 1}),
        ("gemma2", {"nextn_predict_layers": 1}),
        ("cohere2moe", {}),
        ("exaone4", {PATTERN: 1}),  # sliding-window only with 64 layers
        ("gemma-embedding", {PATTERN: 2}),
        ("modern-bert", WINDOW),
        ("gemma4", {PATTERN: [1, 0]}),
    ],
)
def test_sliding_window_patterns_llama_cpp_accepts_validate(
    tmp_path: Path, arch: str, keys: dict[str, Any]
) -> None:
    validate_gguf(header(tmp_path / "m.gguf", keys, arch))


def test_gemma4_keeps_two_layers_with_their_own_kv_cache(tmp_path: Path) -> None:
    keys = {PATTERN: [1, 0], "attention.shared_kv_layers": 1}
    rejects(header(tmp_path / "m.gguf", keys, "gemma4"), "shared_kv_layers = 1", "at least 2")


@pytest.mark.parametrize(
    ("arch", "keys", "source"),
    [
        ("gemma4", {PATTERN: [1, 1, 1, 0]}, 2),  # the full layer 3 reuses layer 2
        ("gemma4", {PATTERN: [1, 0, 1, 1]}, 1),  # the sliding-window layer 3 reuses layer 1
        ("gemma3n", {"block_count": 22, PATTERN: 3}, 19),
    ],
)
def test_shared_kv_layers_need_a_source_of_their_kind(
    tmp_path: Path, arch: str, keys: dict[str, Any], source: int
) -> None:
    shared = {"block_count": 4, "attention.shared_kv_layers": 1} if arch == "gemma4" else {}
    path = header(tmp_path / "m.gguf", {**shared, **keys}, arch)
    rejects(path, f"reuse the KV cache of layer {source}")


def test_shared_kv_layers_with_sources_of_their_kind_validate(tmp_path: Path) -> None:
    keys = {"block_count": 4, "attention.shared_kv_layers": 1, PATTERN: [1, 1, 0, 0]}
    validate_gguf(header(tmp_path / "a.gguf", keys, "gemma4"))
    validate_gguf(header(tmp_path / "b.gguf", {"block_count": 22}, "gemma3n"))


# -- M-RoPE ----------------------------------------------------------------------------------

SECTIONS = "rope.dimension_sections"


@pytest.mark.parametrize(
    ("arch", "sections"),
    [
        ("qwen2vl", [0, 0, 0, 0]),  # some section of the first three must be > 0
        ("qwen2vl", [4, -4, 0, 0]),  # the kernel divides by the sum
        ("qwen2vl", [8, 8, 8, 0]),  # more than the 16 rope dimensions
        ("qwen2vl", (5, VT.INT32)),  # a scalar fills all four
        ("paddleocr", None),  # optional, but always M-RoPE
        ("glm4", [5, 5, -20, 0]),
        ("dflash", [0, 0, 0, 5]),
    ],
)
def test_bad_mrope_sections_are_rejected(tmp_path: Path, arch: str, sections: Any) -> None:
    path = header(tmp_path / "m.gguf", {SECTIONS: sections}, arch)
    rejects(path, f"{arch}.{SECTIONS}", "M-RoPE")


@pytest.mark.parametrize(
    ("arch", "sections"),
    [
        ("qwen2vl", [2, 3, 3, 0]),
        ("qwen2vl", (2, VT.INT32)),
        ("glm4", [0, 5, 5, 0]),  # glm4 uses M-RoPE only when the first two are > 0
        ("glm4", None),
        ("dflash", None),
        ("llama", [0, 0, 0, 0]),  # not an M-RoPE arch
    ],
)
def test_mrope_sections_llama_cpp_accepts_validate(
    tmp_path: Path, arch: str, sections: Any
) -> None:
    validate_gguf(header(tmp_path / "m.gguf", {SECTIONS: sections}, arch))


# -- asserts of single architectures --------------------------------------------------------

HRM = {"hrm.layers_per_stack": 1, "hrm.h_cycles": 1, "hrm.l_cycles": 1}
# Hybrids: layer 0 recurrent (linear attention), layer 1 attention
HYBRID = {"attention.head_count_kv": [0, 2]}
GLM5 = {"attention.indexer.kpool": 4, "attention.indexer.top_k": 8, "hyper_connection.count": 4,
        "rope.dimension_count": 0, **HYBRID}  # fmt: skip
BAILING = {"kda.gate_lower_bound": -5.0, **HYBRID}
DSV4 = {"hyper_connection.count": 4, "attention.output_group_count": 2}
# A DeepSeek-V4 as its converter writes one: one KV head, a lightning indexer (ratio-4 layers)
V4 = {**DSV4, "attention.head_count_kv": 1, "attention.compress_ratios": [4, 128],
      "attention.indexer.key_length": 64}  # fmt: skip
DSPARK = {**DSV4, **WINDOW}
MSA = {"attention.indexer.block_size": 64, "attention.indexer.head_count": 2}


@pytest.mark.parametrize(
    ("arch", "good", "bad"),
    [
        ("gemma-embedding", {PATTERN: 2, "dense_2_feat_in": 64, "dense_3_feat_out": 0},
         {PATTERN: 2, "dense_2_feat_in": 32}),
        ("nanbeige", {"num_loops": 256}, {"num_loops": 257}),
        ("nanbeige", {}, {"num_loops": 0}),
        ("hrm_text", HRM, {**HRM, "hrm.l_cycles": 2}),
        ("hrm_text", HRM, {**HRM, "hrm.h_cycles": 0}),
        ("minimax-m3", MSA, {**MSA, "attention.indexer.block_size": 0}),
        ("glm5-next", GLM5, {**GLM5, "attention.indexer.top_k": 6}),
        ("glm5-next", GLM5, {**GLM5, "hyper_connection.count": 2}),
        ("bailingmoe3", BAILING, {"kda.gate_lower_bound": 0.5}),
        ("bailingmoe3", BAILING, {**BAILING, "kda.safe_gate": False}),
        ("dflash", DSPARK, {**DSPARK, "attention.output_group_count": 0}),
        ("deepseek4", V4, {**V4, "attention.compress_ratios": [4] * 513}),
        # the width llama.cpp copies each output at: its graph's (embedding_length) but where
        # the graph makes its output wider (deepseek4: hyper-connections' hidden width)
        ("llama", {"embedding_length_out": 64}, {"embedding_length_out": 1000}),
        ("bert", {}, {"embedding_length_out": 16}),
        ("deepseek4", {**V4, "embedding_length_out": 256},
         {**V4, "embedding_length_out": 256, "attention.output_group_count": 0}),
    ],
)  # fmt: skip
def test_asserts_of_single_architectures(
    tmp_path: Path, arch: str, good: dict[str, Any], bad: dict[str, Any]
) -> None:
    validate_gguf(header(tmp_path / "good.gguf", good, arch))
    rejects(header(tmp_path / "bad.gguf", bad, arch), f"{arch} needs")


# -- graph and loader invariants of single architectures (src/models/<arch>.cpp) ------------

DELTA = {"ssm.conv_kernel": 4, "ssm.inner_size": 64, "ssm.state_size": 16,
         "ssm.time_step_rank": 4, "ssm.group_count": 2, "full_attention_interval": 2}  # fmt: skip
QWEN35 = {**DELTA, SECTIONS: [4, 4, 0, 0]}
MAMBA2 = {"ssm.inner_size": 64, "ssm.time_step_rank": 4, "ssm.group_count": 2}
GRANITE_HYBRID = {**MAMBA2, "ssm.inner_size": 128, **HYBRID}
PLAMO2 = {**MAMBA2, "ssm.group_count": 0, **HYBRID}
MLA = {"attention.key_length_mla": 48, "attention.value_length_mla": 32,
       "attention.head_count_kv": 1}  # fmt: skip
LFM2 = {**HYBRID, "shortconv.l_cache": 3}
NON_CAUSAL = {"attention.causal": False}
EVERY_HEAD = {"attention.head_count_kv": 4}  # as many KV heads as query heads
RWKV6 = {"wkv.head_size": 16, "attention.head_count_kv": 0}
# nemotron_h: an attention layer, a Mamba-2 layer (neither has a feed-forward), an MLP layer
NEMOTRON_H = {**MAMBA2, "block_count": 3, "attention.head_count_kv": [2, 0, 0],
              "feed_forward_length": [0, 0, 32]}  # fmt: skip
WAVTOKENIZER = {"block_count": 8, "posnet.block_count": 6, "posnet.embedding_length": 32,
                "convnext.embedding_length": 32, "attention.group_norm_groups": 32}  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "good", "bad"),
    [
        # experts the loader asserts (or divides by)
        ("bailingmoe2", MOE, {}),
        ("glm4moe", MOE, {"expert_count": 0}),
        ("qwen35moe", {**QWEN35, **MOE}, QWEN35),
        ("lfm2moe", {**LFM2, "leading_dense_block_count": 2},
         {**LFM2, "leading_dense_block_count": 1}),
        ("grovemoe", {**MOE, "experts_per_group": 2}, {**MOE, "experts_per_group": 0}),
        ("ernie4_5-moe", {"interleave_moe_layer_step": 1}, {"interleave_moe_layer_step": 0}),
        ("nemotron_h", {**MOE, **NEMOTRON_H, "expert_used_count": [0, 0, 2]},
         {**MOE, **NEMOTRON_H, "expert_used_count": [2, 2, 0]}),
        # divisions by head_count at load (gemma2/gemma3 only for their 27B layer count)
        ("olmo2", {}, {"attention.head_count": 0, "attention.head_count_kv": 0}),
        ("gemma2", {"attention.head_count": 0, "attention.head_count_kv": 0},
         {"block_count": 46, "attention.head_count": 0, "attention.head_count_kv": 0}),
        # recurrent layers and their ssm sizes
        ("qwen35", QWEN35, {**QWEN35, "full_attention_interval": 0}),
        ("minimax-01", {"full_attention_interval": 2}, {"full_attention_interval": 0}),
        ("qwen35", QWEN35, {**QWEN35, "ssm.inner_size": 48}),
        ("qwen3next", DELTA, {**DELTA, "ssm.group_count": 3}),
        ("qwen3next", {**DELTA, "attention.recurrent_layers": [1, 0]},
         {**DELTA, "ssm.group_count": 3, "attention.recurrent_layers": [0, 1]}),
        ("mamba2", MAMBA2, {**MAMBA2, "ssm.group_count": 0}),
        ("mamba2", MAMBA2, {**MAMBA2, "ssm.time_step_rank": 3}),
        ("granitehybrid", GRANITE_HYBRID, {**GRANITE_HYBRID, "ssm.group_count": 3}),
        ("granitehybrid", GRANITE_HYBRID, {**GRANITE_HYBRID, "ssm.inner_size": 64}),
        ("jamba", {**HYBRID, "ssm.inner_size": 128}, {**HYBRID, "ssm.inner_size": 96}),
        ("plamo2", PLAMO2, {**PLAMO2, "ssm.group_count": 2}),
        ("lfm2", LFM2, {**LFM2, "attention.value_length": 8}),
        ("lfm2", LFM2, {**LFM2, "shortconv.l_cache": 1}),
        ("lfm2", {**LFM2, **NON_CAUSAL}, {**LFM2, **NON_CAUSAL, "shortconv.l_cache": 4}),
        # MLA, indexer and DeepSeek-V4 attention
        # without MLA: a key of key_length 16 - rope for every query head
        ("deepseek2", {**EVERY_HEAD, "rope.dimension_count": 8}, EVERY_HEAD),
        ("deepseek2", {**EVERY_HEAD, "rope.dimension_count": 8}, {"rope.dimension_count": 8}),
        # with MLA: one latent key of kv_lora_rank + rope
        ("deepseek2", {**MLA, "attention.kv_lora_rank": 8, "rope.dimension_count": 8},
         {**MLA, "attention.kv_lora_rank": 16, "rope.dimension_count": 8}),
        ("kimi-linear", {**MLA, "attention.head_count_kv": [0, 1], "attention.kv_lora_rank": 8,
                         "rope.dimension_count": 8},
         {**MLA, "attention.head_count_kv": [0, 2], "attention.kv_lora_rank": 8,
          "rope.dimension_count": 8}),
        ("deepseek2", {**EVERY_HEAD, "rope.dimension_count": 8, "attention.temperature_scale": 0.1,
                       "attention.temperature_length": 4096},
         {**EVERY_HEAD, "rope.dimension_count": 8, "attention.temperature_scale": 0.1}),
        ("dots1", EVERY_HEAD, {}),
        ("olmoe", EVERY_HEAD, {**EVERY_HEAD, "attention.key_length": 8}),
        ("minimax-m2", {**MOE, "expert_gating_func": 2}, MOE),
        ("llama4", {"block_count": 4}, {}),
        ("llama4", {"block_count": 4}, {"block_count": 4, "attention.sliding_window": 0}),
        ("hy_v4", MLA, {**MLA, "attention.key_length_mla": 0}),
        ("hy_v4", MLA, {**MLA, "attention.key_length_mla": 16}),
        ("deepseek2-ocr", EVERY_HEAD, {**EVERY_HEAD, "rope.freq_base": 5000.0}),
        ("deepseek2-ocr", EVERY_HEAD, {**EVERY_HEAD, "attention.value_length": 8}),
        ("deepseek32", {"attention.indexer.key_length": 64}, {"attention.indexer.key_length": 8}),
        ("glm-dsa", {"attention.indexer.key_length": 128},
         {"attention.indexer.key_length": 96}),
        # the indexer's KV cache holds main layers (an empty one divides by zero)
        ("deepseek32", {"attention.indexer.key_length": 64},
         {"attention.indexer.key_length": 64, "nextn_predict_layers": 2}),
        ("dots3note", {"attention.indexer.key_length": 64, "attention.indexer.types": [0, 1]},
         {"attention.indexer.key_length": 64, "attention.indexer.types": [0, 0]}),
        ("glm-dsa", {"attention.indexer.types": [1, 0]}, {"attention.indexer.types": [0, 1]}),
        ("glm5-next", {**GLM5, "attention.indexer.types": [0, 1]},
         {**GLM5, "attention.indexer.types": [1, 0]}),
        ("glm5-next", GLM5, {**GLM5, "rope.dimension_count": 16}),
        ("deepseek4", V4, {**V4, "hyper_connection.count": 2}),
        ("deepseek4", V4, {**V4, "attention.output_group_count": 3}),
        ("deepseek4", V4, {**V4, "attention.head_count_kv": 2}),
        ("deepseek4", V4, {**V4, "attention.compress_ratios": [0, 128]}),
        ("deepseek4", V4, {**V4, "attention.compress_ratios": [4, 0],
                           "attention.key_length": 64}),
        ("deepseek4", V4, {**V4, "attention.indexer.key_length": 96}),
        ("dflash", DSPARK, {**DSPARK, "hyper_connection.count": 3}),
        ("minimax-m3", MSA, {**MSA, "attention.indexer.head_count": 4}),
        ("minimax-m3", {**MSA, "attention.indexer.head_count": 4, "leading_dense_block_count": 2},
         {**MSA, "attention.indexer.head_count": 4, "leading_dense_block_count": 1}),
        # RWKV
        ("rwkv6", RWKV6, {**RWKV6, "token_shift_count": 1}),
        ("rwkv6", RWKV6, {**RWKV6, "attention.head_count_kv": 2}),  # full-width keys
        ("rwkv7", {"wkv.head_size": 64}, {"wkv.head_size": 0}),
        ("rwkv7", {"wkv.head_size": 64}, {"wkv.head_size": 16}),  # (the wkv7 kernel's step)
        ("arwkv7", {"wkv.head_size": 64, "token_shift_count": 1}, {"wkv.head_size": 64}),
        ("arwkv7", {"wkv.head_size": 64, "token_shift_count": 1},
         {"wkv.head_size": 32, "token_shift_count": 1}),
        ("rwkv6qwen2", {"wkv.head_size": 16, "token_shift_count": 1},
         {"wkv.head_size": 48, "token_shift_count": 1}),
        ("rwkv6qwen2", {"wkv.head_size": 16, "token_shift_count": 1},
         {"wkv.head_size": 8, "token_shift_count": 1, "attention.head_count": 6,
          "attention.head_count_kv": 3}),
        # others
        ("eagle3", {"block_count": 1}, {}),
        ("wavtokenizer-dec", WAVTOKENIZER, {**WAVTOKENIZER, "posnet.block_count": 7}),
        ("wavtokenizer-dec", WAVTOKENIZER, {**WAVTOKENIZER, "convnext.embedding_length": 64}),
        ("wavtokenizer-dec", WAVTOKENIZER, {**WAVTOKENIZER, "attention.group_norm_groups": 0}),
    ],
)  # fmt: skip
def test_graph_invariants_of_single_architectures(
    tmp_path: Path, arch: str, good: dict[str, Any], bad: dict[str, Any]
) -> None:
    validate_gguf(header(tmp_path / "good.gguf", good, arch))
    rejects(header(tmp_path / "bad.gguf", bad, arch), f"{arch} needs")


def vector(n: int) -> np.ndarray:
    return np.ones(n, np.float32)


def layer_tensors(name: str, *shapes: tuple[int, ...]) -> dict[str, np.ndarray]:
    """blk.N.<name>.weight of each shape (numpy order: rows first), one per layer."""
    return {f"blk.{i}.{name}.weight": weights(*shape) for i, shape in enumerate(shapes)}


I64 = gguf.GGMLQuantizationType.I64


@pytest.mark.parametrize(
    ("arch", "keys", "good", "bad"),
    [
        # per-head (4) or per-element (16 x 4) gate rows
        ("laguna", {}, layer_tensors("attn_gate", (4, 64), (64, 64)),
         layer_tensors("attn_gate", (4, 64), (8, 64))),
        ("jina-bert-v2", {"feed_forward_length": 32}, layer_tensors("ffn_up", (32, 64), (64, 64)),
         layer_tensors("ffn_up", (32, 64), (48, 64))),
        ("qwen3tts", {SECTIONS: [4, 4, 0, 0]},
         {"token_embd.weight": weights(8, 64), "output.weight": weights(8, 64)},
         {"token_embd.weight": weights(8, 64), "output.weight": weights(16, 64)}),
        ("eagle3", {"block_count": 1}, {"d2t": (np.zeros(8, np.int64), I64)},
         {"d2t": np.zeros(8, np.float32)}),
        ("rwkv6", RWKV6,
         {f"blk.{i}.time_mix_lerp_{kind}.weight": vector(64) for i, kind in enumerate("wx")}
         | {"blk.1.time_mix_lerp_fused.weight": vector(64)},
         {f"blk.{i}.time_mix_lerp_x.weight": vector(64) for i in range(2)}),
        # nextn layers only: the main graph would run on missing tensors
        ("glm4moe", {**MOE, "nextn_predict_layers": 1},
         {f"blk.{i}.attn_norm.weight": vector(64) for i in range(2)},
         {"blk.1.attn_norm.weight": vector(64)}),
        # LFM2-ColBert's projection makes the output embedding_length_out wide
        ("lfm2", {**LFM2, "embedding_length_out": 128}, {"dense_2_out.weight": weights(128, 64)},
         {}),
    ],
    ids=["laguna-gate", "jina-ffn-up", "qwen3tts-output", "eagle3-d2t", "rwkv6-lerp", "mtp-only",
         "lfm2-dense-2-out"],
)  # fmt: skip
def test_tensors_the_graph_of_single_architectures_needs(
    tmp_path: Path, arch: str, keys: dict[str, Any], good: dict[str, Any], bad: dict[str, Any]
) -> None:
    validate_gguf(header(tmp_path / "good.gguf", keys, arch, tensors=good))
    rejects(header(tmp_path / "bad.gguf", keys, arch, tensors=bad), f"{arch} needs")


def glm_dsa_layers(n: int, indexed: range | list[int]) -> dict[str, np.ndarray]:
    """attn_norm on ``n`` layers, and the three indexer tensors the graph multiplies by on the
    ``indexed`` ones (k_norm is optional in the graph too, so it is never written)."""
    names = ["attn_norm", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj"]
    return {f"blk.{il}.{name}.weight": vector(4) for il in range(n) for name in names
            if name == "attn_norm" or il in indexed}  # fmt: skip


@pytest.mark.parametrize(
    ("keys", "indexed", "missing"),
    [
        # attention.indexer.types marks the layers
        ({"attention.indexer.types": [1, 0]}, [0], None),
        ({"attention.indexer.types": [1, 1]}, [0], "blk.1.indexer.attn_q_b.weight"),
        # default below GLM-5.2's context: every layer full
        ({"context_length": 4096}, [0, 1], None),
        ({"context_length": 4096}, [0], "blk.1.indexer.attn_q_b.weight"),
        # default from GLM-5.2's context: its pattern (0, 1, then every fourth from 2)
        ({"context_length": 1048576, "block_count": 8}, [0, 1, 2, 6], None),
        ({"context_length": 1048576, "block_count": 8}, [0, 1, 2], "blk.6.indexer.attn_q_b"),
        # the nextn (MTP) layer is not part of the main graph
        ({"context_length": 4096, "nextn_predict_layers": 1}, [0], None),
    ],
    ids=["types", "types-missing", "all-full", "all-full-missing", "glm-5.2", "glm-5.2-missing",
         "nextn"],
)  # fmt: skip
def test_glm_dsa_needs_the_indexer_tensors_on_full_indexer_layers(
    tmp_path: Path, keys: dict[str, Any], indexed: list[int], missing: str | None
) -> None:
    path = header(tmp_path / "m.gguf", keys, "glm-dsa",
                  tensors=glm_dsa_layers(keys.get("block_count", 2), indexed))  # fmt: skip
    if missing is None:
        validate_gguf(path)
    else:
        rejects(path, "glm-dsa needs the indexer tensors", missing)


def test_glm_dsa_without_layer_tensors_is_left_to_llama_cpp(tmp_path: Path) -> None:
    # No blk.N.attn_norm: llama.cpp refuses the file itself (a required tensor is missing).
    validate_gguf(header(tmp_path / "m.gguf", {"context_length": 4096}, "glm-dsa"))


def test_a_dspark_markov_head_needs_a_block_size(tmp_path: Path) -> None:
    markov = {"markov_w1.weight": weights(8, 4)}
    validate_gguf(header(tmp_path / "good.gguf", {"block_size": 16}, "dflash", tensors=markov))
    path = header(tmp_path / "bad.gguf", {}, "dflash", tensors=markov)
    rejects(path, "dflash needs block_size > 0")


def test_a_huge_hash_layer_count_is_read_as_a_count(tmp_path: Path) -> None:
    # The check of the hash layers' tables once listed a name per counted layer (2^32 names).
    path = header(tmp_path / "m.gguf", {**V4, "hash_layer_count": 2**32 - 1}, "deepseek4")
    started = time.monotonic()
    validate_gguf(path)  # llama.cpp then refuses the missing tables itself
    assert time.monotonic() - started < 5


def test_dots3note_reads_its_pattern_array_for_layer_0(tmp_path: Path) -> None:
    # dots3note sizes layer 0 by the _swa values when its pattern marks it sliding-window, and
    # (with a create_memory branch of its own) needs no sliding-window layer.
    keys = {"rope.dimension_count": 8, "attention.key_length_swa": 128,
            "rope.dimension_count_swa": 128, "attention.indexer.key_length": 64}  # fmt: skip
    validate_gguf(header(tmp_path / "full.gguf", {**keys, PATTERN: [0, 0]}, "dots3note"))
    path = header(tmp_path / "swa.gguf", {**keys, PATTERN: [1, 0]}, "dots3note")
    rejects(path, "dots3note needs attention.indexer.key_length >= the rope dimensions")


# -- vocabulary and output -------------------------------------------------------------------


def vocabulary(tokens: list[Any], model: str = "llama", **keys: Any) -> dict[str, Any]:
    return {"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": tokens, **keys}


@pytest.mark.parametrize(
    ("tokens", "repeated"),
    [
        (["a", "b", "a"], "a"),
        ([b"a", b"a\0b"], "a"),  # llama.cpp reads C strings: cut at the NUL
        (["", "[EMPTY_0]"], "[EMPTY_0]"),  # an empty token is renamed
    ],
)
def test_repeated_tokens_are_rejected(tmp_path: Path, tokens: list[Any], repeated: str) -> None:
    rejects(header(tmp_path / "m.gguf", vocabulary(tokens)), f"holds {repeated!r} twice")


def test_a_repeat_is_found_anywhere_in_a_large_vocabulary(tmp_path: Path) -> None:
    # Compared in C (llamacrab_gguf_first_repeated_string): many strings of the same length,
    # so its hash table fills and probes; the repeat is the last token, of the first one.
    words = [f"w{i:06d}" for i in range(50_000)]
    validate_gguf(header(tmp_path / "a.gguf", vocabulary(words)))
    rejects(header(tmp_path / "b.gguf", vocabulary([*words, "w000000"])), "'w000000' twice")
    rejects(header(tmp_path / "c.gguf", vocabulary([*words, "w049999\0tail"])), "'w049999' twice")


def test_distinct_tokens_validate_and_a_missing_vocabulary_is_not_read(tmp_path: Path) -> None:
    validate_gguf(header(tmp_path / "a.gguf", vocabulary(["", "", "a", "b"])))
    validate_gguf(header(tmp_path / "b.gguf", vocabulary(["a", "a"], model="none")))


def test_an_empty_vocabulary_is_rejected(tmp_path: Path) -> None:
    # GGUFWriter refuses empty arrays: write one token and cut it out.
    path = header(tmp_path / "m.gguf", vocabulary([""], model="test"))
    data = path.read_bytes()
    one_empty = struct.pack("<IIQQ", 9, 8, 1, 0)  # array of 1 string of 0 bytes
    assert data.count(one_empty) == 1
    path.write_bytes(data.replace(one_empty, struct.pack("<IIQ", 9, 8, 0)))
    rejects(path, "tokenizer.ggml.tokens is empty")


def test_vocabularies_decoded_whole_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gguf_reader, "_MAX_VOCABULARY", 2)
    rejects(header(tmp_path / "m.gguf", vocabulary(["a", "b", "c"])), "3 entries", "at most 2")


def test_byte_tokens_are_rejected_in_a_wordpiece_vocabulary_only(tmp_path: Path) -> None:
    types = {"tokenizer.ggml.token_type": [1, 6]}
    rejects(header(tmp_path / "a.gguf", vocabulary(["a", "<0x41>"], "bert", **types)), "byte")
    validate_gguf(header(tmp_path / "b.gguf", vocabulary(["a", "<0x41>"], "llama", **types)))


def test_a_tied_nvfp4_output_without_its_own_scales(tmp_path: Path) -> None:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.NVFP4]
    rows = np.zeros((8, size * tiny.N_EMBD // block), np.uint8)
    embd = {"token_embd.weight": (rows, gguf.GGMLQuantizationType.NVFP4)}
    scale = {"output.scale": np.ones(1, np.float32)}
    rejects(header(tmp_path / "a.gguf", {}, tensors=embd | scale), "NVFP4", "output.scale")
    validate_gguf(header(tmp_path / "b.gguf", {}, tensors=embd))
    output = {"output.weight": weights(8, tiny.N_EMBD)}
    validate_gguf(header(tmp_path / "c.gguf", {}, tensors=embd | scale | output))


# -- through Llama, and in a child process ---------------------------------------------------


def test_llama_raises_invalid_model_error_naming_the_key(tmp_path: Path) -> None:
    path = tiny_model(tmp_path / "m.gguf", {"expert_count": 4, "expert_used_count": 8})
    with pytest.raises(InvalidModelError, match=r"llama\.expert_used_count"):
        Llama(path, n_ctx=64, n_threads=1)


@pytest.mark.parametrize(
    ("key", "value"),
    [("rope.freq_base", 0.0), ("rope.freq_base", -1.0), ("rope.freq_base", float("nan")),
     ("rope.freq_base_swa", 0.0), ("rope.scale_linear", float("nan")),
     ("rope.scaling.factor", float("inf")), ("rope.scaling.attn_factor", float("nan")),
     ("rope.scaling.attn_factor", 1e30), ("final_logit_softcapping", float("nan")),
     ("final_logit_softcapping", float("inf")), ("logit_scale", float("-inf"))],
)  # fmt: skip
def test_hyperparameters_that_make_every_logit_nan_are_refused_at_load(
    tmp_path: Path, key: str, value: float
) -> None:
    # Such a file loaded, and every decode gave NaN logits: a DecodeError blaming the weights.
    path = tiny_model(tmp_path / "m.gguf", {key: value})
    with pytest.raises(
        InvalidModelError,
        match=rf"llama\.{re.escape(key)} = \S+ must be (a finite|within)",
    ):
        Llama(path, n_ctx=64, n_threads=1)


def test_a_softcap_gemma3_reads_is_refused_where_it_made_nan_logits(tmp_path: Path) -> None:
    # gemma3 reads final_logit_softcapping (the tiny llama's arch does not): NaN there gave
    # NaN logits, a DecodeError at every completion of a model that had loaded.
    keys = {**WINDOW, "final_logit_softcapping": float("nan")}
    path = tiny_model(tmp_path / "m.gguf", keys, "gemma3", gemma_norms())
    checked = load_in_child(path, "checked")
    assert checked.stdout.startswith("InvalidModelError"), checked.stdout + checked.stderr[-2000:]
    assert "gemma3.final_logit_softcapping = nan must be a finite number" in checked.stdout
    unchecked = load_in_child(path, "unchecked")
    assert unchecked.stdout.startswith("DecodeError") and "logit of nan" in unchecked.stdout


def test_rope_values_llama_cpp_reads_as_defaults_load(tmp_path: Path) -> None:
    # 0 for a scale is "none" to llama.cpp; the base is the usual one.
    keys = {"rope.freq_base": 10000.0, "rope.scale_linear": 0.0, "rope.scaling.factor": 0.0,
            "rope.scaling.attn_factor": 1.2}  # fmt: skip
    with Llama(tiny_model(tmp_path / "m.gguf", keys), n_ctx=64, n_threads=1) as llm:
        assert (
            llm.create_completion("the cat", max_tokens=2, min_tokens=2).usage.completion_tokens
            == 2
        )


def test_a_model_saying_it_is_an_adapter_is_still_checked(tmp_path: Path) -> None:
    path = tiny_model(tmp_path / "m.gguf", {"general.type": "adapter", "pooling_type": 9})
    with pytest.raises(InvalidModelError, match=r"llama\.pooling_type = 9"):
        Llama(path, n_ctx=64, n_threads=1)


CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import llamacrab._native.model
    from llamacrab import Batch, Llama, LlamaError
    from llamacrab._native.gguf_reader import read_file
    from llamacrab._native.vocab import Vocab
    if sys.argv[2] == "unchecked":  # the header read, nothing checked
        llamacrab._native.model.validate_gguf = lambda path, **kwargs: read_file(path)[:2]
        Vocab.check_usable = lambda self: None
    try:
        with Llama(sys.argv[1], n_ctx=64, n_threads=1) as llm:
            if llm.model.computes_logits(embeddings=False):
                llm.create_completion("the cat", max_tokens=1)
            else:  # an embedding model: no generation, its decode alone
                with Batch(64) as batch:
                    batch.set(np.array(llm.tokenize("the cat"), np.int32), 0)
                    llm.context.decode(batch)
        print("loaded")
    except LlamaError as error:
        print(type(error).__name__, error)
""")


def load_in_child(path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(path), mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize(
    ("keys", "key"),
    [
        ({"rope.scaling.type": "bogus"}, "llama.rope.scaling.type"),
        ({"expert_count": 4, "expert_used_count": 8}, "llama.expert_used_count"),
        ({"general.type": "adapter", "rope.scaling.type": "bogus"}, "llama.rope.scaling.type"),
        ({"expert_count": 4}, "llama.expert_used_count"),
    ],
)
def test_the_check_turns_an_abort_into_an_error(
    tmp_path: Path, keys: dict[str, Any], key: str
) -> None:
    path = tiny_model(tmp_path / "m.gguf", keys)
    checked = load_in_child(path, "checked")
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert checked.stdout.startswith("InvalidModelError"), checked.stdout
    assert key in checked.stdout
    unchecked = load_in_child(path, "unchecked")
    assert unchecked.returncode == -signal.SIGABRT, (
        f"llama.cpp no longer aborts on {keys} (exit {unchecked.returncode}): re-audit "
        f"docs/native-aborts.md\n{unchecked.stdout}{unchecked.stderr[-2000:]}"
    )
    assert "GGML_ASSERT" in unchecked.stderr


EMBEDDINGS_CHILD = textwrap.dedent("""
    import sys
    import llamacrab._native.model
    from llamacrab import Llama, LlamaError
    from llamacrab._native.gguf_reader import read_file
    if sys.argv[2] == "unchecked":
        llamacrab._native.model.validate_gguf = lambda path, **kwargs: read_file(path)[:2]
    try:
        with Llama(sys.argv[1], n_ctx=64, n_threads=1, embeddings=True, pooling="mean") as llm:
            print("embedded", llm.embed(["the cat", "a dog"]).shape)
    except LlamaError as error:
        print(type(error).__name__, error)
""")


def test_an_output_width_past_the_graph_s_is_refused_not_an_abort(tmp_path: Path) -> None:
    path = tiny_model(tmp_path / "m.gguf", {"embedding_length_out": 1000})
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    runs = {mode: subprocess.run([sys.executable, "-c", EMBEDDINGS_CHILD, str(path), mode],
                                 capture_output=True, text=True, timeout=120, env=env)
            for mode in ("checked", "unchecked")}  # fmt: skip
    assert runs["checked"].returncode == 0, runs["checked"].stderr[-2000:]
    assert runs["checked"].stdout.startswith("InvalidModelError")
    assert "embedding_length_out equal to embedding_length" in runs["checked"].stdout
    assert runs["unchecked"].returncode == -signal.SIGABRT, runs["unchecked"].stdout
    assert "tensor read out of bounds" in runs["unchecked"].stderr


def shrunk_values() -> dict[str, np.ndarray]:
    """attn_v of value heads of 8 (the key heads stay 16)."""
    return {f"blk.{i}.attn_v.weight": weights(tiny.N_HEAD_KV * 8, tiny.N_EMBD) for i in range(2)}


def square_kv() -> dict[str, np.ndarray]:
    """attn_k/attn_v with as many heads as attn_q (deepseek2-ocr sizes them by embedding_length)."""
    return {f"blk.{i}.attn_{x}.weight": weights(tiny.N_EMBD, tiny.N_EMBD)
            for i in range(tiny.N_LAYER) for x in "kv"}  # fmt: skip


EXPERT_FFN = {"expert_feed_forward_length": 32, "expert_shared_count": 1}
OCR = {**EXPERT_FFN, "leading_dense_block_count": 2, "attention.head_count_kv": tiny.N_HEAD}
HY_V4 = {**EXPERT_FFN, **MLA, "attention.q_lora_rank": 16, "attention.kv_lora_rank": 16,
         "hyper_connection.count": 4, "hyper_connection.epsilon": 1e-6,
         "hyper_connection.magnitude": 1.0}  # fmt: skip
TOKENS = tiny.vocabulary()[0]
NO_VOCAB = {"tokenizer.ggml.model": "none", "vocab_size": len(TOKENS)}
T5_BOS = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.add_bos_token": True,
          "tokenizer.ggml.bos_token_id": 100_000}  # fmt: skip
REPEATED = {"tokenizer.ggml.tokens": [*TOKENS[:-1], TOKENS[-2]]}


@pytest.mark.parametrize(
    ("arch", "keys", "tensors", "message", "death"),
    [
        ("llama", {"attention.value_length": 8}, shrunk_values(), "needs attention.value_length",
         "n_embd_head == hparams.n_embd_head_k()"),
        ("gemma3", {**WINDOW, PATTERN: 1}, gemma_norms(), "no layer sliding-window",
         "is_swa_any()"),
        ("gemma-embedding", {**WINDOW, PATTERN: 0}, gemma_norms(), "no layer full-attention",
         "GGML_ASSERT(buffer)"),
        ("qwen2vl", {SECTIONS: [0, 0, 0, 0]}, qkv_biases(), "M-RoPE", "sections[0] > 0"),
        ("qwen2vl", {SECTIONS: [4, -4, 0, 0]}, qkv_biases(), "M-RoPE", "SIGFPE"),
        ("llama", REPEATED, {}, "twice", "id_to_token.size() == token_to_id.size()"),
        ("llama", {"tokenizer.ggml.model": "bert"}, {}, "byte tokens", "fatal error"),
        ("llama", T5_BOS, {}, "bos_token_id", "special_bos_id != LLAMA_TOKEN_NULL"),
        ("llama", NO_VOCAB, {}, "no vocabulary", "Tokenizer not initialized"),
        ("qwen35", {**QWEN35, "full_attention_interval": 0}, {}, "full_attention_interval",
         "SIGFPE"),
        ("olmo2", {"attention.head_count": 0, "attention.head_count_kv": 0}, {},
         "attention.head_count > 0", "SIGFPE"),
        ("qwen35moe", QWEN35, {}, "expert_count > 0", "SIGFPE"),
        ("glm4moe", EXPERT_FFN, {}, "expert_count > 0", "n_expert must be > 0"),
        ("ernie4_5-moe", {**EXPERT_FFN, "interleave_moe_layer_step": 0,
                          "leading_dense_block_count": 2}, {},
         "interleave_moe_layer_step > 0", "n_moe_layer_step > 0"),
        ("hy_v4", {**HY_V4, "attention.key_length_mla": 0}, {}, "key_length_mla > 0",
         "hparams.is_mla()"),
        ("jamba", {**DELTA, "ssm.inner_size": 100}, {}, "ssm.inner_size == 2",
         "2 * n_embd == d_inner"),
        ("deepseek2-ocr", {**OCR, "rope.freq_base": 5000.0}, square_kv(), "rope.freq_base",
         "fabs(freq_base - 10000.0) < 1e-4"),
    ],
    ids=["value-length", "swa-pattern", "swa-encoder", "mrope-zero", "mrope-negative",
         "repeated-token", "wordpiece-bytes", "missing-bos", "no-vocab", "attention-interval",
         "head-count", "experts-divided", "experts-asserted", "moe-layer-step", "mla",
         "ssm-inner-size", "ocr-rope-base"],
)  # fmt: skip
def test_the_new_checks_turn_an_abort_into_an_error(
    tmp_path: Path, arch: str, keys: dict[str, Any], tensors: dict[str, Any], message: str,
    death: str,
) -> None:  # fmt: skip
    path = tiny_model(tmp_path / "m.gguf", keys, arch, tensors)
    assert_checked_else_dies(path, message, death)


def assert_checked_else_dies(path: Path, message: str, death: str) -> None:
    """Loading ``path`` raises InvalidModelError naming ``message``; without the checks the
    child dies of SIGFPE or of the abort whose stderr holds ``death``."""
    checked = load_in_child(path, "checked")
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert checked.stdout.startswith("InvalidModelError") and message in checked.stdout, (
        checked.stdout
    )
    unchecked = load_in_child(path, "unchecked")
    expected = -signal.SIGFPE if death == "SIGFPE" else -signal.SIGABRT
    assert unchecked.returncode == expected, (
        f"llama.cpp no longer dies on {path.name} (exit {unchecked.returncode}): re-audit "
        f"docs/native-aborts.md\n{unchecked.stdout}{unchecked.stderr[-2000:]}"
    )
    assert death == "SIGFPE" or death in unchecked.stderr, unchecked.stderr[-2000:]


OCR_ROPE_CHILD = textwrap.dedent("""
    import sys
    from llamacrab import InvalidParameterError, Llama
    from llamacrab._native import context
    if sys.argv[2] == "unchecked":
        context._check_rope_freq_base = lambda *args: None
    try:
        with Llama(sys.argv[1], n_ctx=64, n_threads=1, rope_freq_base=5000.0) as llm:
            llm.create_completion("the cat", max_tokens=1)
        print("loaded")
    except InvalidParameterError as error:
        print("refused:", error)
""")


def test_deepseek2_ocr_refuses_another_rope_base_from_the_context(tmp_path: Path) -> None:
    # deepseek2.cpp asserts the context's freq_base (not the file's) is 10000 for deepseek2-ocr.
    path = tiny_model(tmp_path / "m.gguf", OCR, "deepseek2-ocr", square_kv())
    for base in (0.0, 10000.0, 10000.0001):  # 0 keeps the file's; 10000.0001 is 10000.0f
        with Llama(path, n_ctx=64, n_threads=1, rope_freq_base=base) as llm:
            assert (
                llm.create_completion("the cat", max_tokens=1, min_tokens=1).usage.completion_tokens
                == 1
            )
    bases = [{"rope_freq_base": base} for base in (5000.0, 10000.01)]
    for options in bases:
        with pytest.raises(InvalidParameterError, match="deepseek2-ocr models need a rope base"):
            Llama(path, n_ctx=64, n_threads=1, **options)
    with pytest.raises(InvalidParameterError, match="rope_freq_base must be finite"):
        Llama(path, n_ctx=64, n_threads=1, rope_freq_base=float("nan"))  # (any architecture)
    with pytest.raises(InvalidParameterError, match=r"rope_freq_base must be 0 .* or a positive"):
        Llama(path, n_ctx=64, n_threads=1, rope_freq_base=-10000.0)  # (any architecture)
    # An override is checked with the file, as the value llama.cpp reads
    override = {"deepseek2-ocr.rope.freq_base": 5000.0}
    with pytest.raises(InvalidModelError, match=r"kv_overrides .* needs rope\.freq_base == 10000"):
        Llama(path, n_ctx=64, n_threads=1, kv_overrides=override)
    with Llama(tiny_model(tmp_path / "llama.gguf", {}), n_ctx=64, rope_freq_base=5000.0):
        pass  # other architectures take any base
    checked = subprocess.run([sys.executable, "-c", OCR_ROPE_CHILD, str(path), "checked"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert checked.returncode == 0 and checked.stdout.startswith("refused:"), checked.stderr
    unchecked = subprocess.run(
        [sys.executable, "-c", OCR_ROPE_CHILD, str(path), "unchecked"], capture_output=True,
        text=True, timeout=120, env={**os.environ, "GGML_NO_BACKTRACE": "1"},
    )  # fmt: skip
    assert unchecked.returncode == -signal.SIGABRT, (
        f"llama.cpp no longer aborts (exit {unchecked.returncode}): re-audit "
        f"docs/native-aborts.md\n{unchecked.stdout}{unchecked.stderr[-2000:]}"
    )
    assert "fabs(freq_base - 10000.0) < 1e-4" in unchecked.stderr


def tiny_lfm2(path: Path, keys: dict[str, Any]) -> Path:
    """The tiny llama turned LFM2: layer 0 a short convolution, layer 1 attention."""
    writer = gguf.GGUFWriter(str(path), "lfm2")
    tiny._metadata(writer, tiny.N_LAYER, 1e-5)
    for key, value in {**LFM2, **keys}.items():
        add(writer, full_key("lfm2", key), value)
    trunk = tiny._tensors(0, len(TOKENS))
    tensors = {name: data for name, data in trunk.items() if not name.startswith("blk.0.attn_")}
    tensors["blk.0.attn_norm.weight"] = trunk["blk.0.attn_norm.weight"]
    tensors["token_embd_norm.weight"] = tensors.pop("output_norm.weight")
    conv = {"conv": (tiny.N_EMBD, keys["shortconv.l_cache"]), "in_proj": (3 * tiny.N_EMBD,
            tiny.N_EMBD), "out_proj": (tiny.N_EMBD, tiny.N_EMBD)}  # fmt: skip
    tensors |= {f"blk.0.shortconv.{name}.weight": weights(*shape) for name, shape in conv.items()}
    head = tiny.N_EMBD // tiny.N_HEAD
    tensors |= {f"blk.1.attn_{x}_norm.weight": np.ones(head, np.float32) for x in "qk"}
    tiny.write_gguf(writer, tensors)
    return path


def test_a_centred_lfm2_convolution_of_even_width_is_refused(tmp_path: Path) -> None:
    # Non-causal LFM2 pads (l_cache - 1) // 2 on each side: with an even l_cache a one-token
    # step leaves the padded input no longer than the conv state (lfm2.cpp:205).
    keys = {**NON_CAUSAL, "shortconv.l_cache": 4}
    path = tiny_lfm2(tmp_path / "m.gguf", keys)
    assert_checked_else_dies(path, "odd shortconv.l_cache", "bx->ne[0] > conv->ne[0]")
    good = tiny_lfm2(tmp_path / "good.gguf", {**keys, "shortconv.l_cache": 3})
    assert load_in_child(good, "checked").stdout.startswith("loaded")


def test_deepseek4_without_an_embedding_length_is_left_to_llama_cpp(tmp_path: Path) -> None:
    """Its rules read layer 0's head sizes, which need an embedding length: they failed an
    assert (an AssertionError escaping validate_gguf, 2 of the archs section's 40,000 long
    cases) where llama.cpp itself refuses the file (a key it requires)."""
    path = header(tmp_path / "m.gguf", {**V4, "embedding_length": None}, "deepseek4")
    validate_gguf(path)
    with pytest.raises(ModelLoadError, match="key not found in model"):
        Llama(path, n_ctx=64, n_threads=1)
