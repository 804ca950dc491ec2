"""Bring your own llama.cpp: what build_tools.prefix reads from an install, and what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from cross_libraries import installed_library

from build_tools import prefix
from build_tools.layout import LINUX
from build_tools.prefix import PrefixError, describe

COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"


def fake_install(root: Path, libs: list[str], commit: str | None = COMMIT) -> Path:
    (root / "include").mkdir(parents=True)
    (root / "include" / "llama.h").write_text("")
    (root / "lib").mkdir()
    for name in libs:
        if name.endswith(".so"):  # a real library: its SONAME is read
            installed_library(root, name.removeprefix("lib").removesuffix(".so"), LINUX)
        else:
            (root / "lib" / name).write_bytes(b"")
    if commit is not None:
        config = root / "lib" / "cmake" / "llama" / "llama-config.cmake"
        config.parent.mkdir(parents=True)
        config.write_text(f"set(LLAMA_VERSION 0.0.1)\nset(LLAMA_BUILD_COMMIT {commit})\n")
    return root


def test_an_install_is_described_with_its_commit_libraries_and_backend(tmp_path: Path) -> None:
    root = fake_install(
        tmp_path, ["libllama.so", "libggml.so", "libggml-base.so", "libggml-cuda.so", "libz.so"]
    )
    info = describe(root)
    assert info["commit"] == COMMIT and info["commit_source"] == "install"
    assert info["source_origin"] == "prefix" and info["backend"] == "cuda"
    # Only llama.cpp's own libraries are linked, whatever else shares the directory.
    assert sorted(Path(p).name for p in info["libraries"]) == [
        "libggml-base.so", "libggml-cuda.so", "libggml.so", "libllama.so"
    ]  # fmt: skip
    assert info["include_dir"] == str(root.resolve() / "include")


def test_a_given_commit_wins_and_dlopen_modules_are_found_in_bin(tmp_path: Path) -> None:
    root = fake_install(tmp_path, ["libllama.so", "libggml.so"], commit="unknown")
    (root / "bin").mkdir()
    (root / "bin" / "libggml-vulkan.so").write_bytes(b"")
    (root / "bin" / "libggml-cpu-haswell.so").write_bytes(b"")
    info = describe(root, "abc123")
    assert (info["commit"], info["commit_source"]) == ("abc123", "given")
    assert info["backend"] == "vulkan" and info["portable"]
    assert [Path(p).name for p in info["modules"]] == [
        "libggml-cpu-haswell.so",
        "libggml-vulkan.so",
    ]


def test_an_install_without_a_commit_asks_for_one(tmp_path: Path) -> None:
    root = fake_install(tmp_path, ["libllama.so"], commit="unknown")
    with pytest.raises(PrefixError, match=prefix.COMMIT_ENV):
        describe(root)


@pytest.mark.parametrize(
    ("libs", "headers", "expected"),
    [(["libllama.so"], False, "include/llama.h"), (["libllama.a"], True, "BUILD_SHARED_LIBS")],
)
def test_what_is_not_a_shared_install_is_refused_by_name(
    tmp_path: Path, libs: list[str], headers: bool, expected: str
) -> None:
    root = fake_install(tmp_path, libs)
    if not headers:
        (root / "include" / "llama.h").unlink()
    with pytest.raises(PrefixError, match=expected):
        describe(root)
