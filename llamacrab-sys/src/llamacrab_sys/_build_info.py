"""What this llamacrab_sys was built from: llama.cpp commit, backend, options, libraries."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamacrab_sys import _backends
from llamacrab_sys._library_path import library_dir, load_recorded, module_dir
from llamacrab_sys._native import ffi, lib


@dataclass(frozen=True)
class BuildInfo:
    package_version: str
    llama_cpp_commit: str
    backend: str
    portable: bool
    rpc: bool
    # Sanitizers the libraries and shims were built with ("address"); "" for a normal build.
    sanitize: str
    cmake_options: tuple[str, ...]
    compilers: dict[str, str]
    library_dir: Path
    libraries: tuple[Path, ...]
    backend_modules: tuple[Path, ...]
    functions: int
    shimmed_functions: int
    skipped_functions: dict[str, str]
    cdef_sha256: str
    # Where dlopen-only backend modules are looked for (the library directory by default).
    module_dir: Path
    # Feature groups the llama.cpp bound lacks, e.g. "multimodal (libmtmd)" (build_tools).
    unavailable_features: tuple[str, ...] = ()
    # Bring your own llama.cpp: the install bound in place (None for the shipped libraries), and
    # whether its commit was recorded by the install ("install") or given at build time ("given").
    llama_cpp_prefix: Path | None = None
    commit_source: str = "pin"
    # llamacrab's changes to the pinned source (build_tools/patches.py); none for a local
    # checkout or a user's install, which are built or bound as they are.
    llama_cpp_patches: tuple[str, ...] = ()

    @property
    def missing_backends(self) -> dict[str, str]:
        """Backends built in but unusable in this process (no driver, no device): name -> why."""
        return _backends.missing()

    @property
    def system_info(self) -> str:
        """llama.cpp's own summary of the CPU features and backends in use."""
        return ffi.string(lib.llama_print_system_info()).decode("utf-8", "replace").strip()

    def as_dict(self) -> dict[str, Any]:
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        fields["library_dir"] = str(self.library_dir)
        fields["libraries"] = [str(p) for p in self.libraries]
        fields["backend_modules"] = [str(p) for p in self.backend_modules]
        fields["module_dir"] = str(self.module_dir)
        fields["unavailable_features"] = list(self.unavailable_features)
        fields["llama_cpp_patches"] = list(self.llama_cpp_patches)
        fields["llama_cpp_prefix"] = self.llama_cpp_prefix and str(self.llama_cpp_prefix)
        fields["missing_backends"] = self.missing_backends
        fields["system_info"] = self.system_info
        return fields


@functools.cache
def build_info() -> BuildInfo:
    raw = load_recorded()
    # A user's llama.cpp (LLAMACRAB_LLAMA_CPP_PREFIX) is loaded where it is installed.
    libraries_at, modules_at = library_dir(raw), module_dir(raw)
    prefix = raw.get("llama_cpp_prefix")
    return BuildInfo(
        package_version=raw["package_version"],
        llama_cpp_commit=raw["llama_cpp_commit"],
        backend=raw["backend"],
        portable=raw["portable"],
        rpc=raw["rpc"],
        sanitize=raw.get("sanitize", ""),
        cmake_options=tuple(raw["cmake_options"]),
        compilers=raw["compilers"],
        library_dir=libraries_at,
        libraries=tuple(libraries_at / name for name in raw["libraries"]),
        backend_modules=tuple(modules_at / name for name in raw["backend_modules"]),
        functions=raw["functions"],
        shimmed_functions=raw["shimmed_functions"],
        skipped_functions=raw["skipped_functions"],
        cdef_sha256=raw["cdef_sha256"],
        module_dir=modules_at,
        unavailable_features=tuple(raw.get("unavailable_features", ())),
        llama_cpp_prefix=Path(prefix) if prefix else None,
        commit_source=raw.get("commit_source", "pin"),
        llama_cpp_patches=tuple(raw.get("llama_cpp_patches", ())),
    )
