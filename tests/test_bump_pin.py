"""scripts/bump_pin.py: the pin and the supported commits it writes, the assert-table diff."""

from __future__ import annotations

import json
from pathlib import Path

from llamacrab._native import sys_check

from support import REPO, load_repo_module

bump_pin = load_repo_module("scripts/bump_pin.py")

NEW = "1234567890abcdef" * 2 + "12345678"


def test_the_new_commit_joins_the_supported_ones() -> None:
    text = (REPO / "llamacrab/src/llamacrab/_native/sys_check.py").read_text()
    updated = bump_pin.add_supported(text, NEW)
    namespace: dict[str, object] = {}
    line = next(x for x in updated.splitlines() if x.startswith("SUPPORTED_LLAMA_CPP_COMMITS"))
    exec(line, namespace)
    assert namespace["SUPPORTED_LLAMA_CPP_COMMITS"] == sys_check.SUPPORTED_LLAMA_CPP_COMMITS | {NEW}
    # Twice is the same as once.
    assert bump_pin.add_supported(updated, NEW) == updated


def test_the_new_pin_is_one_the_build_can_fetch() -> None:
    pin = bump_pin.new_pin(NEW, "ab" * 32)
    archive = pin["source_archive"]
    assert pin["llama_cpp_commit"] == NEW
    assert archive["url"] == f"https://github.com/ggml-org/llama.cpp/archive/{NEW}.tar.gz"
    # GitHub's archive holds one top-level folder, <repo>-<commit>: the tree the build extracts.
    assert archive["tree"] == f"llama.cpp-{NEW}"
    current = json.loads((REPO / "llamacrab-sys/pin.json").read_text())["source_archive"]
    assert set(archive) == set(current) - {"pip_requirement"} | {"url"}


def test_asserts_diff_shows_new_and_moved_lines(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    for tree, body in [
        (old, "int a;\nGGML_ASSERT(x > 0);\n"),
        (new, 'int a;\nint b;\nGGML_ASSERT(x > 0);\nGGML_ABORT("no");\n'),
    ]:
        (tree / "src/models").mkdir(parents=True)
        (tree / "src/llama-model.cpp").write_text(body)
        (tree / "src/models/llama.cpp").write_text("GGML_ASSERT(n_embd_head == 64);\n")
        for name in bump_pin.ASSERT_FILES[1:]:
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            (tree / name).write_text("")
    diff = bump_pin.asserts(old, new).splitlines()
    assert "-src/llama-model.cpp:2:GGML_ASSERT(x > 0);" in diff
    assert "+src/llama-model.cpp:3:GGML_ASSERT(x > 0);" in diff
    assert '+src/llama-model.cpp:4:GGML_ABORT("no");' in diff
    # An unchanged line is context at most, never a change.
    changed = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert len(changed) == 3
    assert any(line == " src/models/llama.cpp:1:GGML_ASSERT(n_embd_head == 64);" for line in diff)
