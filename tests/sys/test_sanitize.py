"""Sanitizer builds (LLAMACRAB_SANITIZE, CI's AddressSanitizer job): their CMake options, their
own cache entry, and the build info that records them."""

from __future__ import annotations

import pytest

from build_tools import native
from build_tools.source import resolve_source
from llamacrab_sys import build_info


def test_a_sanitizer_instruments_every_target_and_keys_its_own_cache_entry() -> None:
    plain = native.cmake_options("cpu", False, False, [])
    asan = native.cmake_options("cpu", False, False, [], "address")
    flags = "-fsanitize=address -fno-omit-frame-pointer"
    for option in ("C_FLAGS", "CXX_FLAGS", "SHARED_LINKER_FLAGS"):
        assert f"-DCMAKE_{option}={flags}" in asan
    assert not any("sanitize" in option for option in plain)
    source = resolve_source()
    ids = native.compilers("cpu", plain)
    assert native.cache_key(source, "cpu", plain, ids, []) != native.cache_key(
        source, "cpu", asan, ids, []
    )
    both = native.sanitizer_flags("address, undefined")
    assert both[:2] == ["-fsanitize=address", "-fno-omit-frame-pointer"]
    assert "-fsanitize=undefined" in both and native.sanitizer_flags("") == []
    with pytest.raises(SystemExit, match="unknown sanitizer 'thread'"):
        native.sanitizer_flags("thread")


def test_the_build_info_records_the_sanitizer() -> None:
    info = build_info()
    assert info.sanitize in ("", "address")
    instrumented = any("-fsanitize=address" in option for option in info.cmake_options)
    assert instrumented == (info.sanitize == "address")
    assert info.as_dict()["sanitize"] == info.sanitize
