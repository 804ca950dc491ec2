"""Generate the cffi extension source, the shims and the build info from a native build.

Usage: python -m build_tools.bindings --native-json native.json --out-dir DIR [--cc CC]
           [--package-version X.Y.Z]

Writes into DIR: _native.c (cffi API-mode module llamacrab_sys._native), llamacrab_shims.h,
llamacrab_shims.cpp, _cdef.h (the declarations cffi was given), _build_info.json and
libraries.cmake (what to link and ship).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from pathlib import Path

import cffi

from build_tools import declarations, required_api, shims
from build_tools.declarations import SHIMMED_HEADERS

MODULE_NAME = "llamacrab_sys._native"

# Trampolines through which C calls back into Python (see llamacrab_sys/_callbacks.py).
CALLBACKS_CDEF = """\
extern "Python" void llamacrab_log_callback(enum ggml_log_level, const char *, void *);
extern "Python" bool llamacrab_progress_callback(float, void *);
extern "Python" bool llamacrab_abort_callback(void *);
extern "Python" const char *llamacrab_sampler_name(const struct llama_sampler *);
extern "Python" void llamacrab_sampler_accept(struct llama_sampler *, llama_token);
extern "Python" void llamacrab_sampler_apply(struct llama_sampler *, llama_token_data_array *);
extern "Python" void llamacrab_sampler_reset(struct llama_sampler *);
extern "Python" void llamacrab_sampler_free(struct llama_sampler *);
"""

# The RPC protocol version the pinned ggml-rpc speaks (its header's macros; the compiler supplies
# the values): llamacrab's worker probe checks a worker's HELLO answer against it.
RPC_CDEF = """\
#define RPC_PROTO_MAJOR_VERSION ...
#define RPC_PROTO_MINOR_VERSION ...
#define RPC_PROTO_PATCH_VERSION ...
#define GGML_RPC_MAX_SERVERS ...
"""


def linked_libraries(lib_dir: Path) -> list[Path]:
    """The unversioned shared libraries the module links against (dlopen-only backends excluded)."""
    return sorted(p for p in lib_dir.glob("lib*.so") if p.is_file() or p.is_symlink())


def backend_modules(prefix: Path) -> list[Path]:
    """Backends built for GGML_BACKEND_DL: installed beside executables, loaded at run time."""
    return sorted((prefix / "bin").glob("libggml-*.so"))


def soname(library: Path) -> str:
    out = subprocess.run(
        ["objdump", "-p", str(library)], check=True, capture_output=True, text=True
    )
    for line in out.stdout.splitlines():
        if line.split()[:1] == ["SONAME"]:
            return line.split()[1]
    return library.name


def exported_functions(libraries: list[Path]) -> set[str]:
    symbols: set[str] = set()
    for lib in libraries:
        out = subprocess.run(
            ["nm", "-D", "--defined-only", "--format=posix", str(lib)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[1] in "TtWw":
                symbols.add(parts[0])
    return symbols


def render(include_dirs: list[Path], libraries: list[Path], cc: str = "cc") -> tuple:
    """Return (declarations, shim header, shim source, cdef) for these headers and libraries."""
    headers = declarations.present_headers(include_dirs)
    preprocessed = declarations.preprocess(include_dirs, cc, headers)
    decls = declarations.extract(preprocessed, exported_functions(libraries))
    decls.headers = headers
    shim_header, shim_source, shim_cdef = shims.generate(decls)
    rpc = RPC_CDEF if "ggml-rpc.h" in headers else ""
    return decls, shim_header, shim_source, decls.cdef + shim_cdef + CALLBACKS_CDEF + rpc


def _libraries(native: dict) -> tuple[list[Path], list[Path]]:
    """(libraries to link, dlopen-only backend modules) of a build or of a user's install."""
    if native["source_origin"] == "prefix":
        return [Path(p) for p in native["libraries"]], [Path(p) for p in native["modules"]]
    return linked_libraries(Path(native["lib_dir"])), backend_modules(Path(native["prefix"]))


def _libraries_cmake(native: dict, libraries: list[Path], modules: list[Path]) -> str:
    """For CMake: what to link, what to ship under which name, where the module finds them."""
    if native["source_origin"] == "prefix":
        # A user's install is used in place (build_tools/prefix.py says why): nothing shipped.
        shipped: list[Path] = []
        modules = []
        rpath = native["lib_dir"]
    else:
        shipped, rpath = libraries, "$ORIGIN/lib"
    return (
        "set(LLAMACRAB_LINK_LIBRARIES\n" + "".join(f'  "{p}"\n' for p in libraries) + ")\n"
        "set(LLAMACRAB_SHIPPED_FILES\n" + "".join(f'  "{p.resolve()}"\n' for p in shipped) + ")\n"
        "set(LLAMACRAB_SHIPPED_NAMES\n" + "".join(f'  "{soname(p)}"\n' for p in shipped) + ")\n"
        "set(LLAMACRAB_BACKEND_MODULES\n" + "".join(f'  "{p}"\n' for p in modules) + ")\n"
        f'set(LLAMACRAB_RPATH "{rpath}")\n'
    )


def generate(native: dict, out_dir: Path, cc: str = "cc", package_version: str = "") -> dict:
    libraries, modules = _libraries(native)
    decls, shim_header, shim_source, cdef = render([Path(native["include_dir"])], libraries, cc)
    unavailable = required_api.check(decls, native["include_dir"])

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "llamacrab_shims.h").write_text(shim_header)
    (out_dir / "llamacrab_shims.cpp").write_text(shim_source)
    (out_dir / "_cdef.h").write_text(cdef)

    builder = cffi.FFI()
    builder.cdef(cdef)
    builder.set_source(MODULE_NAME, '#include "llamacrab_shims.h"\n')
    builder.emit_c_code(str(out_dir / "_native.c"))

    info = {
        "package_version": package_version,
        "llama_cpp_commit": native["commit"],
        "source_origin": native["source_origin"],
        "llama_cpp_patches": native.get("patches", []),
        "backend": native["backend"],
        "portable": native["portable"],
        "rpc": native["rpc"],
        "sanitize": native.get("sanitize", ""),
        "cmake_options": native["cmake_options"],
        "compilers": native["compilers"],
        "native_cache_key": native["key"],
        "libraries": [soname(p) for p in libraries],
        "backend_modules": [p.name for p in modules],
        "cdef_sha256": hashlib.sha256(cdef.encode()).hexdigest(),
        "functions": len(decls.functions),
        "shimmed_functions": sum(h in SHIMMED_HEADERS for h in decls.function_headers.values()),
        "skipped_functions": decls.skipped,
        "unavailable_features": unavailable,
    }
    if native["source_origin"] == "prefix":
        # Loaded in place: build_info() points at the install, not at the package's lib/.
        info["llama_cpp_prefix"] = native["prefix"]
        info["commit_source"] = native["commit_source"]
        info["library_dir"] = native["lib_dir"]
        info["module_dir"] = native["module_dir"]
    (out_dir / "libraries.cmake").write_text(_libraries_cmake(native, libraries, modules))
    (out_dir / "_build_info.json").write_text(json.dumps(info, indent=2, sort_keys=True))
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--native-json", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--cc", default="cc")
    parser.add_argument("--package-version", default="")
    args = parser.parse_args()
    native = json.loads(args.native_json.read_text())
    info = generate(native, args.out_dir, args.cc, args.package_version)
    print(f"llamacrab: {info['functions']} functions, {info['shimmed_functions']} shims generated")


if __name__ == "__main__":
    main()
