"""kv_overrides as llama.cpp's loader applies them to a GGUF header, and as it renders them."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from llamacrab._exceptions import InvalidParameterError
from llamacrab._native.gguf import archs
from llamacrab._native.gguf_reader import (
    BOOL,
    FLOAT32,
    INT32,
    SCALARS,
    STRING,
    GgufArray,
    Reader,
)


def overridden(
    reader: Reader, metadata: dict[str, Any], overrides: Mapping[str, int | float | str]
) -> tuple[Reader, dict[str, Any]]:
    """The header as llama.cpp's loader reads it with ``overrides``: an override instead of the
    file's value (or where it has none), read by any getter of its kind (an integer one by any
    integer type); an array too, where llama.cpp reads the key with get_key (the override comes
    before the type check), not where it reads the file's array (``archs.
    READ_ONLY_FROM_FILE``). Refused where llama.cpp would ignore it, and these checks would pass
    a header it never reads: an override of another kind than the file's value (its getter
    reads the file's kind, and warns), or of a key the file lacks that llama.cpp reads only from
    the file. The split.* keys, which tell llama.cpp the files to load, are never overridden:
    it would load parts never checked."""
    seen, merged = copy.copy(reader), dict(metadata)
    seen.types = dict(reader.types)
    seen.failing = f"{reader.path.name} with kv_overrides {dict(overrides)} would not load safely"
    arch = str(overrides.get("general.architecture", metadata.get("general.architecture")))
    for key, value in overrides.items():
        if key.startswith("split."):
            raise InvalidParameterError(
                f"kv_overrides[{key!r}]: the split.* keys say which files make up the model "
                "(llama.cpp would load parts that were never checked)"
            )
        array = isinstance(metadata.get(key), GgufArray)
        if archs.read_only_from_file(key, arch):
            if array:
                continue  # llama.cpp reads the array
            if key not in metadata:
                raise InvalidParameterError(
                    f"kv_overrides[{key!r}]: {reader.path.name} has no {key}, and llama.cpp "
                    "reads that key only from the file (it would ignore the override)"
                )
        kind = next(kind for type_, kind in _OVERRIDE_KINDS if isinstance(value, type_))
        if key in reader.types and not array and _stored_kind(reader.types[key]) != kind:
            raise InvalidParameterError(
                f"kv_overrides[{key!r}] = {value!r} is {_KIND_NAMES[kind]}; {reader.path.name} "
                f"stores {_KIND_NAMES[_stored_kind(reader.types[key])]} there (llama.cpp would "
                "ignore the override)"
            )
        merged[key] = value
        seen.types[key] = {"bool": BOOL, "int": INT32, "float": FLOAT32, "str": STRING}[kind]
    return seen, merged


def applied_overrides(
    metadata: Mapping[str, Any], overrides: Mapping[str, int | float | str]
) -> dict[str, str]:
    """The ``overrides`` llama.cpp applies to a model whose header validate_gguf returned as
    ``metadata`` (all but those of arrays it reads as such), each as llama_model_meta_val_str
    renders a value of its kind. That getter shows the file's values: guards of a loaded model
    read these over them."""
    return {
        key: meta_string(value)
        for key, value in overrides.items()
        if not isinstance(metadata.get(key), GgufArray)
    }


def meta_string(value: int | float | str) -> str:
    """A scalar as llama.cpp renders metadata (gguf_kv_to_str: std::to_string, true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:f}" if isinstance(value, float) else str(value)


_OVERRIDE_KINDS = ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"))
_KIND_NAMES = {"bool": "a boolean", "int": "an integer", "float": "a float", "str": "a string"}


def _stored_kind(gguf_type: int) -> str:
    """The kind of override llama.cpp's getter for a value of this GGUF type takes."""
    formats = {"?": "bool", "f": "float", "d": "float"}
    return "str" if gguf_type == STRING else formats.get(SCALARS.get(gguf_type, ""), "int")
