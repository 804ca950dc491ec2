"""Turn the installed llama.cpp headers into cffi declarations.

pcpp, a C preprocessor in Python, expands the real headers (attributes and GNU extensions defined
away, linemarkers kept) the same way on every system and with any compiler (MSVC's cl takes none
of GCC's preprocessing flags), pycparser parses the result, and only nodes that come from the
llama/ggml/gguf/mtmd headers are kept. Everything cffi must not take literally (computed array
sizes, enum values) is left to the C compiler with `...`, so API mode checks every layout and
value against the headers at build time.
"""

from __future__ import annotations

import copy
import io
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pcpp
from pycparser import c_ast, c_generator, c_parser

# Headers whose declarations form the binding, in include order. ggml-rpc.h is installed by
# every build; its functions exist only where the RPC backend was built (GGML_RPC).
HEADERS = (
    "llama.h", "gguf.h", "ggml-backend.h", "ggml-cpu.h", "ggml-rpc.h", "mtmd.h", "mtmd-helper.h",
)  # fmt: skip
# An install a user brings may lack these (upstream installs mtmd.h only with its tools).
OPTIONAL_HEADERS = ("ggml-rpc.h", "mtmd.h", "mtmd-helper.h")
# Functions whose C++ implementation may throw: each gets an exception-safe shim.
SHIMMED_HEADERS = ("llama.h", "gguf.h", "ggml-rpc.h", "mtmd.h", "mtmd-helper.h")

# Just enough of the C library for the headers to parse; cffi knows these types natively.
_STAND_INS = {
    "stddef.h": "typedef unsigned long size_t; typedef long ptrdiff_t;\n#define NULL ((void*)0)\n",
    "stdint.h": "".join(
        f"typedef {c} {n}; "
        for n, c in [
            ("int8_t", "signed char"),
            ("uint8_t", "unsigned char"),
            ("int16_t", "short"),
            ("uint16_t", "unsigned short"),
            ("int32_t", "int"),
            ("uint32_t", "unsigned int"),
            ("int64_t", "long"),
            ("uint64_t", "unsigned long"),
            ("intptr_t", "long"),
            ("uintptr_t", "unsigned long"),
        ]
    )
    + "\n#define INT32_MAX 2147483647\n",
    # A typedef, not C's macro: generated code then says bool, which C++ (the shims) knows too.
    "stdbool.h": "typedef _Bool bool;\n#define true 1\n#define false 0\n",
    "stdio.h": "typedef struct _IO_FILE FILE;\n",
    "stdarg.h": "typedef void * va_list;\n",
    "inttypes.h": "#include <stdint.h>\n",
}

# Attributes and GNU extensions defined away; the export macros set as for a shared library. No
# system's macros (_WIN32, __APPLE__, __GNUC__) are defined: the declarations are the same on all.
_DEFINITIONS = (
    "__attribute__(x)", "__restrict", "__restrict__", "__extension__", "__inline", "__inline__",
    "__asm__(x)", "__declspec(x)", "LLAMA_SHARED 1", "GGML_SHARED 1", "__STDC__ 1",
    "__STDC_VERSION__ 201112L", "__x86_64__ 1",
)  # fmt: skip


@dataclass
class Declarations:
    """What the headers declare, ready for cffi and the shim generator."""

    cdef: str
    functions: dict[str, c_ast.Decl] = field(default_factory=dict)
    function_headers: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    # Enumerators and struct fields (by struct or typedef name): what required_api checks.
    constants: set[str] = field(default_factory=set)
    structs: dict[str, set[str]] = field(default_factory=dict)
    headers: tuple[str, ...] = HEADERS


def present_headers(include_dirs: list[Path]) -> tuple[str, ...]:
    """HEADERS found in the include directories; only an optional one may be missing."""
    found = tuple(h for h in HEADERS if any((d / h).is_file() for d in include_dirs))
    required = [h for h in HEADERS if h not in found and h not in OPTIONAL_HEADERS]
    if required:
        dirs = ", ".join(map(str, include_dirs))
        raise SystemExit(f"llamacrab: {', '.join(required)} not found in {dirs}")
    return found


class _Preprocessor(pcpp.Preprocessor):
    """pcpp writing GCC's linemarkers, with its errors collected instead of printed."""

    def __init__(self) -> None:
        super().__init__()
        self.line_directive = "#"
        # llama.h's comments hold UTF-8 (a Greek sigma, "approximately"); pcpp would read
        # them in the locale's encoding, which fails under East Asian code pages (cp932).
        self.assume_encoding = "utf-8"
        self.errors: list[str] = []

    def on_error(self, file: str, line: int, msg: str) -> None:
        self.errors.append(f"{file}:{line}: {msg}")
        self.return_code += 1


def preprocess(include_dirs: list[Path], headers: tuple[str, ...] = HEADERS) -> str:
    with tempfile.TemporaryDirectory() as stand_in_dir:
        for name, text in _STAND_INS.items():
            (Path(stand_in_dir) / name).write_text(text, encoding="utf-8")
        preprocessor = _Preprocessor()
        for definition in _DEFINITIONS:
            preprocessor.define(definition)
        for directory in [stand_in_dir, *include_dirs]:
            preprocessor.add_path(str(directory))
        umbrella = "".join(f'#include "{h}"\n' for h in headers)
        preprocessor.parse(umbrella, str(Path(stand_in_dir) / "llamacrab_all.h"))
        out = io.StringIO()
        preprocessor.write(out)
    if preprocessor.return_code:
        problems = "; ".join(preprocessor.errors) or "an #error directive"
        raise SystemExit(f"llamacrab: preprocessing the llama.cpp headers failed: {problems}")
    return out.getvalue()


def _from_wanted_header(node: c_ast.Node, header_names: set[str]) -> bool:
    return node.coord is not None and Path(str(node.coord.file)).name in header_names


def _is_literal(expr: c_ast.Node | None) -> bool:
    return expr is None or (isinstance(expr, c_ast.Constant) and expr.type == "int")


class _Members(c_ast.NodeVisitor):
    """Collect enumerator names and the fields of every struct (anonymous unions flattened)."""

    def __init__(self, decls: Declarations) -> None:
        self.decls = decls

    def visit_Enumerator(self, node: c_ast.Enumerator) -> None:
        self.decls.constants.add(node.name)

    def visit_Typedef(self, node: c_ast.Typedef) -> None:
        inner = node.type.type if isinstance(node.type, c_ast.TypeDecl) else None
        if isinstance(inner, c_ast.Struct) and inner.decls is not None:
            self.decls.structs[node.name] = _fields(inner)
        self.generic_visit(node)

    def visit_Struct(self, node: c_ast.Struct) -> None:
        if node.name and node.decls is not None:
            self.decls.structs[node.name] = _fields(node)
        self.generic_visit(node)


def _fields(node: c_ast.Struct | c_ast.Union) -> set[str]:
    names: set[str] = set()
    for decl in node.decls or []:
        inner = decl.type.type if isinstance(decl.type, c_ast.TypeDecl) else decl.type
        if decl.name is None and isinstance(inner, (c_ast.Struct, c_ast.Union)):
            names |= _fields(inner)
        elif decl.name is not None:
            names.add(decl.name)
    return names


class _Loosen(c_ast.NodeVisitor):
    """Hand computed array sizes and enum values to the compiler (`...`)."""

    def visit_ArrayDecl(self, node: c_ast.ArrayDecl) -> None:
        if not _is_literal(node.dim):
            node.dim = c_ast.ID("__dotdotdot__")
        self.generic_visit(node)

    def visit_EnumeratorList(self, node: c_ast.EnumeratorList) -> None:
        for enumerator in node.enumerators:
            enumerator.value = None
        node.enumerators.append(c_ast.Enumerator("__dotdotdot__", None))


def _uses_varargs(decl: c_ast.Decl) -> bool:
    params = decl.type.args.params if decl.type.args else []
    return any(isinstance(p, c_ast.EllipsisParam) for p in params) or "va_list" in str(
        c_generator.CGenerator().visit(decl)
    )


def extract(preprocessed: str, exported: set[str] | None) -> Declarations:
    """Keep llama.cpp's own declarations; drop functions no linked library exports."""
    ast = c_parser.CParser().parse(preprocessed, filename="<llamacrab>")
    gen = c_generator.CGenerator()
    wanted = {"llama.h", "llama-cpp.h", "gguf.h", "mtmd.h", "mtmd-helper.h"} | {
        n for n in _header_names(preprocessed) if n.startswith("ggml")
    }
    out: list[str] = []
    seen_typedefs: set[str] = set()
    decls = Declarations(cdef="")
    for node in ast.ext:
        if not _from_wanted_header(node, wanted):
            continue
        if isinstance(node, c_ast.FuncDef):  # static inline helpers: not part of the ABI
            continue
        _Members(decls).visit(node)
        node = copy.deepcopy(node)
        if isinstance(node, c_ast.Typedef):
            if node.name in seen_typedefs:
                continue
            seen_typedefs.add(node.name)
        if isinstance(node, c_ast.Decl) and isinstance(node.type, c_ast.FuncDecl):
            if _uses_varargs(node):
                decls.skipped[node.name] = "variadic"
                continue
            if exported is not None and node.name not in exported:
                decls.skipped[node.name] = "not exported by the built libraries"
                continue
            node.storage = []
            decls.functions[node.name] = node
            decls.function_headers[node.name] = Path(str(node.coord.file)).name
        elif isinstance(node, c_ast.Decl) and node.init is not None:
            # `static const size_t X = sizeof(...)`: let the compiler supply the value.
            node.init = None
            node.storage = []
            out.append("static " + gen.visit(node) + ";")
            continue
        _Loosen().visit(node)
        out.append(gen.visit(node).replace("__dotdotdot__", "...") + ";")
    decls.cdef = "\n".join(out) + "\n"
    return decls


def _header_names(preprocessed: str) -> set[str]:
    names = set()
    for line in preprocessed.splitlines():
        if line.startswith("# ") and '"' in line:
            names.add(Path(line.split('"')[1]).name)
    return names
