"""Generate the cffi extension source, the shims and the build info from a native build.

Usage: python -m build_tools.bindings --native-json native.json --out-dir DIR
           [--package-version X.Y.Z]

Writes into DIR: _native.c (cffi API-mode module llamacrab_sys._native), llamacrab_shims.h,
llamacrab_shims.cpp, _cdef.h (the declarations cffi was given), _build_info.json and
libraries.cmake (what to link and ship).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import cffi

from build_tools import binaries, declarations, layout, required_api, shims
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


def render(include_dirs: list[Path], libraries: list[Path]) -> tuple:
    """Return (declarations, shim header, shim source, cdef) for these headers and libraries."""
    headers = declarations.present_headers(include_dirs)
    preprocessed = declarations.preprocess(include_dirs, headers)
    decls = declarations.extract(preprocessed, binaries.exported_functions(libraries))
    decls.headers = headers
    shim_header, shim_source, shim_cdef = shims.generate(decls)
    rpc = RPC_CDEF if "ggml-rpc.h" in headers else ""
    return decls, shim_header, shim_source, decls.cdef + shim_cdef + CALLBACKS_CDEF + rpc


def _libraries(native: dict) -> tuple[list[layout.Library], list[Path]]:
    """(libraries to link, dlopen-only backend modules) of a build or of a user's install."""
    linked = layout.libraries(Path(native["lib_dir"]))
    return linked, layout.backend_modules(Path(native["prefix"]), linked)


def _cmake_list(name: str, items: list[str]) -> str:
    # Bracket arguments: nothing inside is expanded or unescaped (Windows paths, $ORIGIN).
    return f"set({name}\n" + "".join(f"  [==[{item}]==]\n" for item in items) + ")\n"


def _libraries_cmake(native: dict, libraries: list[layout.Library], modules: list[Path]) -> str:
    """For CMake: what to link, what to ship under which name, where the module finds them."""
    if native["source_origin"] == "prefix":
        # A user's install is used in place (build_tools/prefix.py says why): nothing shipped.
        shipped: list[layout.Library] = []
        modules = []
        rpath = native["runtime_dir"]
    else:
        shipped, rpath = libraries, layout.current().module_rpath
    return (
        _cmake_list("LLAMACRAB_LINK_LIBRARIES", [p.link.as_posix() for p in libraries])
        + _cmake_list("LLAMACRAB_SHIPPED_FILES", [p.runtime.as_posix() for p in shipped])
        + _cmake_list("LLAMACRAB_SHIPPED_NAMES", [p.name for p in shipped])
        + _cmake_list("LLAMACRAB_BACKEND_MODULES", [p.as_posix() for p in modules])
        + _cmake_list("LLAMACRAB_RPATH", [rpath])
    )


def generate(native: dict, out_dir: Path, package_version: str = "") -> dict:
    libraries, modules = _libraries(native)
    runtimes = [library.runtime for library in libraries]
    decls, shim_header, shim_source, cdef = render([Path(native["include_dir"])], runtimes)
    unavailable = required_api.check(decls, native["include_dir"])

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "llamacrab_shims.h").write_text(shim_header, encoding="utf-8")
    (out_dir / "llamacrab_shims.cpp").write_text(shim_source, encoding="utf-8")
    (out_dir / "_cdef.h").write_text(cdef, encoding="utf-8")

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
        "libraries": [library.name for library in libraries],
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
        info["library_dir"] = native["runtime_dir"]
        info["module_dir"] = native["module_dir"]
    (out_dir / "libraries.cmake").write_text(
        _libraries_cmake(native, libraries, modules), encoding="utf-8"
    )
    (out_dir / "_build_info.json").write_text(
        json.dumps(info, indent=2, sort_keys=True), encoding="utf-8"
    )
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--native-json", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--package-version", default="")
    args = parser.parse_args()
    native = json.loads(args.native_json.read_text(encoding="utf-8"))
    info = generate(native, args.out_dir, args.package_version)
    print(f"llamacrab: {info['functions']} functions, {info['shimmed_functions']} shims generated")


if __name__ == "__main__":
    main()
