"""scripts/vulkan_sdk.sh, offline: the checks on a cached prefix and the CMake arguments it prints.

The download itself (Debian's archive) is exercised by the Vulkan wheel build, not here.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from support import REPO

SCRIPT = REPO / "scripts/vulkan_sdk.sh"


def _cached_prefix(out: Path, major: int, minor: int, patch: int) -> None:
    """A prefix as a finished fetch leaves it, with headers of the given version."""
    include = out / "root/usr/include/vulkan"
    include.mkdir(parents=True)
    (include / "vulkan_core.h").write_text(
        f"#define VK_HEADER_VERSION {patch}\n"
        "#define VK_HEADER_VERSION_COMPLETE "
        f"VK_MAKE_API_VERSION(0, {major}, {minor}, VK_HEADER_VERSION)\n"
    )
    spirv = out / "root/usr/share/cmake/SPIRV-Headers"
    spirv.mkdir(parents=True)
    (spirv / "SPIRV-HeadersConfig.cmake").write_text("")
    (out / ".complete").touch()


def _run(out: Path, glslc: str = "/bin/true", **env: str) -> subprocess.CompletedProcess[str]:
    library = out.parent / "libvulkan.so.1"
    library.touch()
    full_env = {**os.environ, "VULKAN_GLSLC": glslc, "VULKAN_LIBRARY": str(library), **env}
    return subprocess.run(
        ["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=full_env, timeout=60
    )


def test_new_enough_headers_give_the_cmake_arguments(tmp_path: Path) -> None:
    out = tmp_path / "sdk"
    _cached_prefix(out, 1, 4, 309)
    result = _run(out)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        f"-DVulkan_INCLUDE_DIR={out}/root/usr/include",
        f"-DVulkan_LIBRARY={tmp_path}/libvulkan.so.1",
        "-DVulkan_GLSLC_EXECUTABLE=/bin/true",
        f"-DSPIRV-Headers_DIR={out}/root/usr/share/cmake/SPIRV-Headers",
    ]
    assert "Vulkan headers 1.4.309" in result.stderr


@pytest.mark.parametrize(("version", "ok"), [((1, 3, 239), False), ((1, 3, 261), True)])
def test_headers_older_than_layer_settings_are_refused(
    tmp_path: Path, version: tuple[int, int, int], ok: bool
) -> None:
    out = tmp_path / "sdk"
    _cached_prefix(out, *version)
    result = _run(out)
    assert (result.returncode == 0) is ok, result.stderr
    if not ok:
        assert "Vulkan headers 1.3.239" in result.stderr
        assert "older than 1.3.261" in result.stderr
        assert result.stdout == ""


def test_a_glslc_that_does_not_run_is_named(tmp_path: Path) -> None:
    out = tmp_path / "sdk"
    _cached_prefix(out, 1, 4, 309)
    result = _run(out, glslc="/bin/false")
    assert result.returncode != 0
    assert "/bin/false does not run" in result.stderr


def test_a_fetch_without_the_debian_keyring_says_what_to_install(tmp_path: Path) -> None:
    result = _run(tmp_path / "sdk", VULKAN_SDK_KEYRING=str(tmp_path / "absent.gpg"))
    assert result.returncode != 0
    assert "install debian-archive-keyring" in result.stderr
