"""The API a user's llama.cpp is checked against: complete, and its failures name what lacks."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from build_tools import bindings, declarations, required_api
from build_tools.declarations import Declarations
from build_tools.source import resolve_source
from llamacrab_sys import build_info

REPO = Path(__file__).resolve().parents[2]
SOURCES = [
    REPO / "llamacrab" / "src" / "llamacrab",
    REPO / "llamacrab-sys" / "src" / "llamacrab_sys",
]
# lib.X and call("X") (the shim of X), across line breaks.
USES = re.compile(r"(?<![\w.])lib\.(\w+)|\bcall\(\s*\"(\w+)\"")


def used_names() -> set[str]:
    names = set()
    for root in SOURCES:
        for path in root.rglob("*.py"):
            for match in USES.finditer(path.read_text()):
                names.add((match.group(1) or match.group(2)).removeprefix("safe_"))
    # Our own shims, their error codes and callback trampolines come with every build.
    # ("lib.safe_<name>" in prose leaves an empty name.)
    return {n for n in names if n and not n.lower().startswith("llamacrab_")}


def listed_names() -> set[str]:
    names = set(required_api.CORE_FUNCTIONS) | set(required_api.CORE_CONSTANTS)
    names |= set(required_api.PATCH_FUNCTIONS)
    for group in required_api.OPTIONAL_GROUPS:
        names |= set(group.functions) | set(group.constants)
    # The RPC protocol macros come from build_tools.bindings.RPC_CDEF with ggml-rpc.h.
    return names | set(re.findall(r"#define (\w+)", bindings.RPC_CDEF))


@pytest.fixture(scope="module")
def pinned() -> Declarations:
    tree = resolve_source().path
    include_dirs = [tree / "include", tree / "ggml/include", tree / "tools/mtmd"]
    decls, *_ = bindings.render(include_dirs, list(build_info().libraries))
    return decls


def test_every_name_llamacrab_uses_is_checked() -> None:
    unlisted = used_names() - listed_names()
    assert not unlisted, f"add to build_tools/required_api.py: {sorted(unlisted)}"
    assert len(used_names()) > 150  # the scan sees the sources


def test_the_pinned_headers_have_everything(pinned: Declarations) -> None:
    assert required_api.check(pinned, "the pin") == []
    assert set(required_api.PATCH_FUNCTIONS) <= set(pinned.functions)  # the patched tree's
    assert "val_i64" in pinned.structs["llama_model_kv_override"]  # an anonymous union's field


def test_an_older_api_is_refused_with_the_names_it_lacks(pinned: Declarations) -> None:
    old = copy.deepcopy(pinned)
    del old.functions["llama_sampler_init_adaptive_p"]
    old.structs["llama_context_params"].discard("kv_unified")
    old.constants.discard("LLAMA_FLASH_ATTN_TYPE_AUTO")
    with pytest.raises(required_api.ApiTooOldError) as caught:
        required_api.check(old, "/opt/llama")
    message = str(caught.value)
    assert "/opt/llama" in message
    for name in ("function llama_sampler_init_adaptive_p", "field llama_context_params.kv_unified",
                 "constant LLAMA_FLASH_ATTN_TYPE_AUTO"):  # fmt: skip
        assert name in message


def test_a_feature_built_out_entirely_is_reported_not_refused(pinned: Declarations) -> None:
    without = copy.deepcopy(pinned)
    for name in list(without.functions):
        if name.startswith("mtmd_"):
            del without.functions[name]
    assert required_api.check(without, "x") == ["multimodal (libmtmd)"]
    # Half a feature is an old or broken install, not an absent one.
    half = copy.deepcopy(pinned)
    del half.functions["mtmd_tokenize"]
    with pytest.raises(required_api.ApiTooOldError, match=r"function mtmd_tokenize \(multimodal"):
        required_api.check(half, "x")


def test_only_optional_headers_may_be_missing() -> None:
    tree = resolve_source().path
    assert "mtmd.h" not in declarations.present_headers([tree / "include", tree / "ggml/include"])
    with pytest.raises(SystemExit, match=r"llama\.h"):
        declarations.present_headers([tree / "ggml/include"])
