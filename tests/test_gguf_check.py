"""validate_gguf rejects the header values that reach a GGML_ASSERT in llama.cpp (the NEEDS CHECK
rows of docs/native-aborts.md), and still accepts real files.

Most cases write a header-only GGUF (metadata, no tensors) and call validate_gguf directly; a few
load a tiny model with a bad value through Llama, in a child process, to show the process survives
with the check and, for the asserts this file names, dies without it (a tripwire for the weekly
llama.cpp bump: if an unchecked load stops aborting, re-audit that row).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import gguf
import pytest

from llamacrab import InvalidModelError, Llama
from llamacrab._native.gguf_check import LLAMA_MAX_EXPERTS, LLAMA_MAX_LAYERS, validate_gguf

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
    elif isinstance(value, list):
        writer.add_array(key, value)
        return
    else:
        vtype = VT.UINT32
    writer.add_key_value(key, value, vtype)


def full_key(arch: str, key: str) -> str:
    return key if key.startswith(("general.", "adapter.")) else f"{arch}.{key}"


def header(path: Path, keys: dict[str, Any], arch: str = "llama") -> Path:
    """A GGUF with BASE plus ``keys`` (``{arch}.`` prefixed; None removes a BASE key)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {**BASE, **keys}.items():
        if value is not None:
            add(writer, full_key(arch, key), value)
    tiny.write_gguf(writer, {})
    return path


def tiny_model(path: Path, keys: dict[str, Any]) -> Path:
    """The tiny llama model with ``keys`` added or overwritten."""
    writer = gguf.GGUFWriter(str(path), "llama")
    tiny._metadata(writer, tiny.N_LAYER, 1e-5)
    for key, value in keys.items():
        add(writer, full_key("llama", key), value)
    tiny.write_gguf(writer, tiny._tensors(0, len(tiny.vocabulary()[0])))
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


def test_expert_gating_func_in_range(tmp_path: Path) -> None:
    for value in (1, 2, 3, 4):
        validate_gguf(header(tmp_path / f"{value}.gguf", {"expert_gating_func": value}))


# -- experts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "keys",
    [
        {"expert_count": 8, "expert_used_count": 2},
        {"expert_count": 8, "expert_used_count": [2, 8]},
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
    ],
)
def test_bad_heads_and_rope_dimensions_are_rejected(
    tmp_path: Path, keys: dict[str, Any], fragments: list[str]
) -> None:
    rejects(header(tmp_path / "m.gguf", keys), *fragments)


@pytest.mark.parametrize(
    "keys",
    [
        {"attention.head_count_kv": [2, 0]},  # a layer without attention (hybrid models)
        {"attention.head_count_kv": None},  # defaults to head_count
        {"rope.dimension_count": 16},
        {"rope.dimension_count": 8},  # partial rotary
        {"attention.key_length": 32, "rope.dimension_count": 32},
        {"attention.head_count": 0, "rope.dimension_count": 33},  # no heads: never read
    ],
)
def test_good_heads_and_rope_dimensions_validate(tmp_path: Path, keys: dict[str, Any]) -> None:
    validate_gguf(header(tmp_path / "m.gguf", keys))


# -- through Llama, and in a child process ---------------------------------------------------


def test_llama_raises_invalid_model_error_naming_the_key(tmp_path: Path) -> None:
    path = tiny_model(tmp_path / "m.gguf", {"expert_count": 4, "expert_used_count": 8})
    with pytest.raises(InvalidModelError, match=r"llama\.expert_used_count"):
        Llama(path, n_ctx=64, n_threads=1)


def test_a_model_saying_it_is_an_adapter_is_still_checked(tmp_path: Path) -> None:
    path = tiny_model(tmp_path / "m.gguf", {"general.type": "adapter", "pooling_type": 9})
    with pytest.raises(InvalidModelError, match=r"llama\.pooling_type = 9"):
        Llama(path, n_ctx=64, n_threads=1)


CHILD = textwrap.dedent("""
    import sys
    import llamacrab._native.model
    from llamacrab import Llama, LlamaError
    if sys.argv[2] == "unchecked":
        llamacrab._native.model.validate_gguf = lambda *args, **kwargs: None
    try:
        Llama(sys.argv[1], n_ctx=64, n_threads=1)
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
