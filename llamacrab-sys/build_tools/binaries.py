"""What a shared library exports, and the name the loader knows it by: ELF, Mach-O and PE.

Read here in Python because the binutils that would tell (nm -D, objdump -p) exist on Linux only:
macOS has otool and a different nm, Windows dumpbin inside a Visual Studio shell. Only what the
build needs is read: exported function names (which declarations the library really defines) and
its load name (ELF SONAME, Mach-O install name, PE export name), under which it is shipped.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class BinaryFormatError(ValueError):
    """The file is not a shared library in a format read here, or it is truncated."""


@dataclass(frozen=True)
class SharedLibrary:
    """A shared library's exported functions and its load name (None where it records none)."""

    functions: frozenset[str]
    load_name: str | None


def read(path: Path) -> SharedLibrary:
    return _parse(path, _shared_library)


def _parse(path: Path, parser: Callable[[bytes], T]) -> T:
    try:
        return parser(path.read_bytes())
    except BinaryFormatError as exc:
        raise BinaryFormatError(f"{path}: {exc}") from None
    except (struct.error, IndexError, ValueError) as exc:  # ValueError: a string runs off the end
        raise BinaryFormatError(f"{path}: truncated or malformed ({exc})") from exc


def _shared_library(data: bytes) -> SharedLibrary:
    if data[:4] == b"\x7fELF":
        return _elf(data)
    if data[:2] == b"MZ":
        return _pe(data)
    return _mach_o(data)


def exported_functions(libraries: list[Path]) -> set[str]:
    return set().union(*(read(lib).functions for lib in libraries))


def load_name(library: Path) -> str:
    """The file name the dynamic loader looks for: the SONAME's or install name's last part."""
    name = read(library).load_name
    return name.rsplit("/", 1)[-1] if name else library.name


def _c_string(data: bytes, offset: int) -> str:
    end = data.index(b"\0", offset)
    return data[offset:end].decode()


# ELF: the dynamic symbol table and the DT_SONAME entry of the dynamic section.
_SHT_DYNAMIC, _SHT_DYNSYM = 6, 11
_STT_FUNC, _STT_GNU_IFUNC = 2, 10
_STB_GLOBAL, _STB_WEAK = 1, 2
_STV_HIDDEN, _STV_INTERNAL = 2, 1
_DT_SONAME = 14


def _elf(data: bytes) -> SharedLibrary:
    if data[4] != 2:
        raise BinaryFormatError("a 32-bit ELF file (only 64-bit libraries are built)")
    end = "<" if data[5] == 1 else ">"
    (shoff,) = struct.unpack_from(end + "Q", data, 0x28)
    shentsize, shnum = struct.unpack_from(end + "HH", data, 0x3A)
    # (type, offset, size, link, entry size) of every section
    sections = []
    for i in range(shnum):
        fields = struct.unpack_from(end + "IIQQQQIIQQ", data, shoff + i * shentsize)
        sections.append((fields[1], fields[4], fields[5], fields[6], fields[9]))
    functions: set[str] = set()
    soname = None
    for kind, offset, size, link, entsize in sections:
        strings = sections[link][1] if link < len(sections) else 0
        if kind == _SHT_DYNSYM and entsize:
            for at in range(offset + entsize, offset + size, entsize):  # entry 0 is null
                name, info, other, shndx = struct.unpack_from(end + "IBBH", data, at)
                defined = shndx != 0
                visible = other & 3 not in (_STV_HIDDEN, _STV_INTERNAL)
                if (
                    defined and visible
                    and info >> 4 in (_STB_GLOBAL, _STB_WEAK)
                    and info & 0xF in (_STT_FUNC, _STT_GNU_IFUNC)
                ):  # fmt: skip
                    functions.add(_c_string(data, strings + name))
        elif kind == _SHT_DYNAMIC and entsize:
            for at in range(offset, offset + size, entsize):
                tag, value = struct.unpack_from(end + "qQ", data, at)
                if tag == _DT_SONAME:
                    soname = _c_string(data, strings + value)
    return SharedLibrary(frozenset(functions), soname)


# Mach-O: LC_ID_DYLIB names the library; external symbols defined in a section of instructions
# (nlist entries of LC_SYMTAB) are its functions, spelt with a leading underscore.
_FAT_MAGIC, _MH_MAGIC_64, _MH_MAGIC = 0xCAFEBABE, 0xFEEDFACF, 0xFEEDFACE
_LC_SYMTAB, _LC_ID_DYLIB, _LC_SEGMENT_64 = 0x2, 0xD, 0x19
_N_STAB, _N_TYPE, _N_EXT, _N_SECT = 0xE0, 0x0E, 0x01, 0x0E
_S_INSTRUCTIONS = 0x80000000 | 0x00000400  # S_ATTR_PURE_INSTRUCTIONS | S_ATTR_SOME_INSTRUCTIONS


def _mach_o(data: bytes) -> SharedLibrary:
    if struct.unpack_from(">I", data)[0] == _FAT_MAGIC:
        # A universal binary: every slice exports the same API; read the first.
        (offset,) = struct.unpack_from(">I", data, 8 + 8)
        return _mach_o(data[offset:])
    (magic,) = struct.unpack_from("<I", data)
    if magic == _MH_MAGIC:
        raise BinaryFormatError("a 32-bit Mach-O file (only 64-bit libraries are built)")
    if magic != _MH_MAGIC_64:
        raise BinaryFormatError("not an ELF, Mach-O or PE file")
    (ncmds,) = struct.unpack_from("<I", data, 16)
    at = 32  # after the mach_header_64
    install_name = None
    code_sections: set[int] = set()  # 1-based, counted over all segments in order
    section_count = 0
    symtab = None
    for _ in range(ncmds):
        cmd, cmdsize = struct.unpack_from("<II", data, at)
        if cmdsize < 8:  # one that does not advance would be read ncmds (up to 2**32) times
            raise BinaryFormatError(f"a load command of {cmdsize} bytes")
        if cmd == _LC_SEGMENT_64:
            (nsects,) = struct.unpack_from("<I", data, at + 64)
            for i in range(nsects):  # section_64 records of 80 bytes, flags at 64
                (flags,) = struct.unpack_from("<I", data, at + 72 + i * 80 + 64)
                section_count += 1
                if flags & _S_INSTRUCTIONS:
                    code_sections.add(section_count)
        elif cmd == _LC_ID_DYLIB:
            (name_offset,) = struct.unpack_from("<I", data, at + 8)
            install_name = _c_string(data, at + name_offset)
        elif cmd == _LC_SYMTAB:
            symtab = struct.unpack_from("<IIII", data, at + 8)
        at += cmdsize
    functions: set[str] = set()
    if symtab:
        symoff, nsyms, stroff, _ = symtab
        for i in range(nsyms):  # nlist_64 records of 16 bytes
            strx, kind, sect, _, _ = struct.unpack_from("<IBBHQ", data, symoff + i * 16)
            defined_here = kind & _N_STAB == 0 and kind & _N_TYPE == _N_SECT
            if defined_here and kind & _N_EXT and sect in code_sections:
                functions.add(_c_string(data, stroff + strx).removeprefix("_"))
    return SharedLibrary(frozenset(functions), install_name)


# PE: the export directory (data directory 0) names the DLL and its exports; a function is an
# export whose address lies in an executable section (one inside the directory is a forwarder).
_PE32_PLUS = 0x20B
_SCN_MEM_EXECUTE = 0x20000000


def _pe(data: bytes) -> SharedLibrary:
    (pe,) = struct.unpack_from("<I", data, 0x3C)
    if data[pe : pe + 4] != b"PE\0\0":
        raise BinaryFormatError("an MZ file without a PE header")
    (nsections,) = struct.unpack_from("<H", data, pe + 6)
    (optional_size,) = struct.unpack_from("<H", data, pe + 20)
    optional = pe + 24
    (magic,) = struct.unpack_from("<H", data, optional)
    if magic != _PE32_PLUS:
        raise BinaryFormatError("a 32-bit PE file (only 64-bit libraries are built)")
    export_rva, export_size = struct.unpack_from("<II", data, optional + 112)
    # (virtual address, virtual size, file offset, characteristics) of every section
    sections = []
    for i in range(nsections):
        at = optional + optional_size + i * 40
        vsize, vaddr, _, raw = struct.unpack_from("<IIII", data, at + 8)
        (flags,) = struct.unpack_from("<I", data, at + 36)
        sections.append((vaddr, vsize, raw, flags))

    def section_of(rva: int) -> tuple[int, int, int, int]:
        for section in sections:
            if section[0] <= rva < section[0] + section[1]:
                return section
        raise BinaryFormatError(f"address {rva:#x} lies in no section")

    def offset(rva: int) -> int:
        vaddr, _, raw, _ = section_of(rva)
        return rva - vaddr + raw

    if not export_rva:
        return SharedLibrary(frozenset(), None)
    directory = offset(export_rva)
    (name_rva,) = struct.unpack_from("<I", data, directory + 12)
    _, _, nnames, functions_rva, names_rva, ordinals_rva = struct.unpack_from(
        "<IIIIII", data, directory + 16
    )
    functions: set[str] = set()
    for i in range(nnames):
        (name,) = struct.unpack_from("<I", data, offset(names_rva) + 4 * i)
        (ordinal,) = struct.unpack_from("<H", data, offset(ordinals_rva) + 2 * i)
        (address,) = struct.unpack_from("<I", data, offset(functions_rva) + 4 * ordinal)
        forwarder = export_rva <= address < export_rva + export_size
        if not forwarder and section_of(address)[3] & _SCN_MEM_EXECUTE:
            functions.add(_c_string(data, offset(name)))
    return SharedLibrary(frozenset(functions), _c_string(data, offset(name_rva)))


def import_library_target(path: Path) -> str:
    """The DLL a Windows import library (MSVC's .lib, lld's .dll.a) links to."""
    return _parse(path, _import_target)


def _import_target(data: bytes) -> str:
    # Both linkers write the short import format: an ar archive of one member per symbol, each a
    # 20-byte header (signatures 0 and 0xFFFF) followed by the symbol's name and the DLL's.
    if data[:8] != b"!<arch>\n":
        raise BinaryFormatError("not an import library (an ar archive)")
    targets = set()
    at = 8
    while at + 60 <= len(data):
        size = int(data[at + 48 : at + 58].decode().strip() or 0)
        member = data[at + 60 : at + 60 + size]
        if member[:4] == b"\0\0\xff\xff":
            symbol_end = member.index(b"\0", 20)
            targets.add(_c_string(member, symbol_end + 1))
        at += 60 + size + size % 2
    if len(targets) != 1:
        found = ", ".join(sorted(targets)) or "none"
        raise BinaryFormatError(f"an import library must name one DLL (found {found})")
    return targets.pop()
