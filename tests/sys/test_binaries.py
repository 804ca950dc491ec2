"""build_tools.binaries reads exports and load names from ELF, Mach-O and PE libraries.

The Mach-O and PE libraries are cross-compiled from one C file by zig's clang (the ziglang wheel),
so every format is checked against what its source says it exports; the ELF reader is also checked
against binutils on the llama.cpp libraries this package ships.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from cross_libraries import cross_compile

import llamacrab_sys
from build_tools import binaries
from build_tools.binaries import BinaryFormatError

SOURCE = """\
#ifdef _WIN32
#define API __declspec(dllexport)
#else
#define API __attribute__((visibility("default")))
#endif
API int llama_alpha(int x) { return x + 1; }
API void llama_beta(void) {}
API int llama_data = 3;                        /* exported, but not a function */
static int hidden(int x) { return x * 2; }
int internal_helper(int x) { return hidden(x); } /* not exported: hidden by default */
"""
EXPORTED = {"llama_alpha", "llama_beta"}

# target -> (file name, linker flags naming the library); 64-bit only, as our wheels are
TARGETS = {
    "x86_64-linux-gnu": ("libfix.so", ["-Wl,-soname,libfix.so.1"]),
    "aarch64-macos": ("libfix.dylib", ["-Wl,-install_name,@rpath/libfix.1.dylib"]),
    "x86_64-macos": ("libfix-x86.dylib", ["-Wl,-install_name,@rpath/libfix.1.dylib"]),
    "x86_64-windows-gnu": ("fix.dll", []),
}
LOAD_NAMES = {".so": "libfix.so.1", ".dylib": "@rpath/libfix.1.dylib", ".dll": "fix.dll"}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("binaries")
    (out / "fix.c").write_text(SOURCE)
    return {
        target: cross_compile(out / "fix.c", target, out / name, flags)
        for target, (name, flags) in TARGETS.items()
    }


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_format_gives_the_exported_functions_and_the_load_name(
    built: dict[str, Path], target: str
) -> None:
    library = binaries.read(built[target])
    assert library.functions == EXPORTED
    assert library.load_name == LOAD_NAMES[built[target].suffix]


def test_the_shipped_file_name_is_the_load_names_last_part(built: dict[str, Path]) -> None:
    assert binaries.load_name(built["aarch64-macos"]) == "libfix.1.dylib"
    assert binaries.load_name(built["x86_64-linux-gnu"]) == "libfix.so.1"
    assert binaries.load_name(built["x86_64-windows-gnu"]) == "fix.dll"


def test_a_universal_mach_o_is_read_through_its_first_slice(
    built: dict[str, Path], tmp_path: Path
) -> None:
    arm = built["aarch64-macos"].read_bytes()
    intel = built["x86_64-macos"].read_bytes()
    # fat_header and two fat_arch records (big-endian), slices aligned to 16 KiB.
    first = 1 << 14
    second = first + (len(arm) + first - 1) // first * first
    header = struct.pack(">II", 0xCAFEBABE, 2)
    header += struct.pack(">iiIII", 0x0100000C, 0, first, len(arm), 14)
    header += struct.pack(">iiIII", 0x01000007, 3, second, len(intel), 14)
    fat = tmp_path / "libfat.dylib"
    fat.write_bytes(header.ljust(first, b"\0") + arm.ljust(second - first, b"\0") + intel)
    assert binaries.read(fat) == binaries.read(built["aarch64-macos"])


@pytest.mark.skipif(shutil.which("nm") is None, reason="binutils' nm is the reference")
def test_the_elf_reader_agrees_with_binutils_on_the_shipped_libraries() -> None:
    for path in llamacrab_sys.build_info().libraries:
        out = subprocess.run(
            ["nm", "-D", "--defined-only", "--format=posix", str(path)],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        by_nm = {line.split()[0] for line in out.splitlines() if line.split()[1] in "TtWwi"}
        library = binaries.read(path)
        assert library.functions == by_nm, path
        assert library.load_name == path.name  # shipped under its SONAME


def test_what_is_not_a_library_is_refused_by_name(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a library at all")
    with pytest.raises(BinaryFormatError, match=r"notes\.txt: not an ELF, Mach-O or PE"):
        binaries.read(text)


def test_a_32_bit_library_is_refused_as_such(tmp_path: Path) -> None:
    source = tmp_path / "fix.c"
    source.write_text(SOURCE)
    elf32 = cross_compile(source, "x86-linux-musl", tmp_path / "libfix32.so", [])
    with pytest.raises(BinaryFormatError, match=r"libfix32\.so: a 32-bit ELF"):
        binaries.read(elf32)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_truncated_library_is_refused_not_misread(
    built: dict[str, Path], target: str, tmp_path: Path
) -> None:
    data = built[target].read_bytes()
    cut = tmp_path / built[target].name
    for size in (3, 64, 200, len(data) // 2, len(data) - 64):
        cut.write_bytes(data[:size])
        try:
            library = binaries.read(cut)
        except BinaryFormatError as exc:
            assert cut.name in str(exc)
        else:  # a cut that spares everything read must still read right
            assert library == binaries.read(built[target]), size


def test_an_import_library_names_its_dll(tmp_path: Path) -> None:
    source = tmp_path / "fix.c"
    source.write_text(SOURCE)
    implib = tmp_path / "fix.lib"
    flags = [f"-Wl,--out-implib,{implib}"]
    cross_compile(source, "x86_64-windows-gnu", tmp_path / "fix.dll", flags)
    assert binaries.import_library_target(implib) == "fix.dll"
    with pytest.raises(BinaryFormatError, match=r"fix\.dll: not an import library"):
        binaries.import_library_target(tmp_path / "fix.dll")


def test_a_mach_o_load_command_that_does_not_advance_is_refused(tmp_path: Path) -> None:
    # mach_header_64 claiming 2**32 - 1 load commands, the first of 0 bytes: read as given, the
    # loop would stay on it for each of them.
    header = struct.pack("<IiiIIII4x", 0xFEEDFACF, 0x0100000C, 0, 6, 0xFFFFFFFF, 0, 0)
    hostile = tmp_path / "libloop.dylib"
    hostile.write_bytes(header + struct.pack("<II", 0x26, 0))  # LC_FUNCTION_STARTS, not read
    with pytest.raises(BinaryFormatError, match=r"libloop\.dylib: a load command of 0 bytes"):
        binaries.read(hostile)
