"""llamacrab's patches to the pinned llama.cpp source (build_tools/patches.py): each applies
exactly once to the pin, a moved source fails by the patch's name, the build that was installed
is the patched one and says so, and the patch set is part of every cache key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from build_tools import native, patches
from build_tools.cache import CACHE_ENV
from build_tools.source import LOCAL_CHECKOUT_ENV, SourceError, read_pin, resolve_source
from llamacrab_sys import build_info


def test_every_patch_applies_exactly_once_to_the_pinned_source() -> None:
    pristine = resolve_source(patched=False)
    assert not pristine.patches
    for patch in patches.PATCHES:
        original = (pristine.path / patch.path).read_text(encoding="utf-8")
        changed = patches.patched_text(patch, original)
        for old, new in patch.edits:
            assert original.count(old) == 1 and new in changed


def test_the_installed_libraries_were_built_from_the_patched_tree() -> None:
    source = resolve_source()
    names = patches.names()  # a patch over several files has one entry per file
    if source.origin == "local":  # a local checkout is built as it is
        assert source.patches == () and build_info().llama_cpp_patches == ()
        return
    assert source.patches == names and source.patches_digest == patches.digest()
    assert build_info().llama_cpp_patches == names
    assert build_info().as_dict()["llama_cpp_patches"] == list(names)
    for patch in patches.PATCHES:
        text = (source.path / patch.path).read_text(encoding="utf-8")
        assert all(new in text for _, new in patch.edits)
    pristine = resolve_source(patched=False).path
    assert pristine != source.path
    for patch in patches.PATCHES:  # the archive's own tree stays as released
        assert all(old in (pristine / patch.path).read_text() for old, _ in patch.edits)


def test_a_source_that_moved_under_a_patch_fails_by_its_name(tmp_path: Path) -> None:
    patch = patches.PATCHES[0]
    target = tmp_path / patch.path
    target.parent.mkdir(parents=True)
    target.write_text("// upstream rewrote this function\n")
    with pytest.raises(patches.PatchError, match=f"{patch.name}.*refresh or drop"):
        patches.apply(tmp_path)
    target.unlink()
    with pytest.raises(patches.PatchError, match="is not in"):
        patches.apply(tmp_path)


def _fake_pristine_tree(cache: Path, text: str) -> Path:
    """A cached "extracted" pin holding only the patched files, each with ``text``."""
    tree = cache / "src" / read_pin()["llama_cpp_commit"]
    for patch in patches.PATCHES:
        (tree / patch.path).parent.mkdir(parents=True, exist_ok=True)
        (tree / patch.path).write_text(text)
    (tree / ".llamacrab-extracted").write_text("fake\n")
    return tree


def test_the_patched_copy_is_made_once_and_the_release_tree_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(LOCAL_CHECKOUT_ENV, raising=False)
    released = "\n".join(old for p in patches.PATCHES for old, _ in p.edits)
    pristine = _fake_pristine_tree(tmp_path, released)
    source = resolve_source()
    assert source.path != pristine and source.origin == "cache"
    assert source.path.name.endswith(patches.digest()[:16])
    for path in {patch.path for patch in patches.PATCHES}:
        assert (pristine / path).read_text() == released
        expected = released  # each patch of this file, in order
        for patch in (patch for patch in patches.PATCHES if patch.path == path):
            expected = patches.patched_text(patch, expected)
        assert (source.path / path).read_text() == expected
    assert resolve_source().path == source.path  # reused, not patched again
    assert resolve_source(patched=False).path == pristine


def test_a_pin_the_patches_no_longer_fit_leaves_no_tree_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(LOCAL_CHECKOUT_ENV, raising=False)
    pristine = _fake_pristine_tree(tmp_path, "// a newer llama.cpp\n")
    with pytest.raises(SourceError, match=patches.PATCHES[0].name):
        resolve_source()
    assert sorted(p.name for p in pristine.parent.iterdir() if p.is_dir()) == [pristine.name]


def test_the_patch_set_is_part_of_the_build_cache_key() -> None:
    source = resolve_source()
    options = native.cmake_options("cpu", False, False, [])
    ids = native.compilers("cpu", options)
    other = dataclasses.replace(source, patches_digest="another patch set")
    assert native.cache_key(source, "cpu", options, ids, []) != native.cache_key(
        other, "cpu", options, ids, []
    )
