"""ControlVector: the directions of GGUF control-vector files, summed per layer, as
``llama_set_adapter_cvec`` takes them. Plain data (no native handle): a context copies it.

A file holds one F32 vector ``direction.<layer>`` per layer (layer >= 1), all of the same
length, the model's n_embd; each file has a strength (scale) and files add up, as llama.cpp's
common loader does."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llamacrab._exceptions import InvalidModelError, InvalidParameterError
from llamacrab._field_types import decimal, file_path, is_number, path_is
from llamacrab._native.gguf_reader import LLAMA_MAX_LAYERS, read_gguf_tensors

_F32 = 0  # GGML_TYPE_F32

ControlVectorSource = str | os.PathLike[str] | tuple[str | os.PathLike[str], float]


@dataclass(frozen=True, eq=False)
class ControlVector:
    """Directions per layer (``directions[i]`` is layer i + 1), summed over the files."""

    directions: np.ndarray  # float32, shape (max_layer, n_embd)
    sources: tuple[tuple[str, float], ...]
    model_hint: str | None = None  # the architecture the files say they were made for

    @property
    def n_embd(self) -> int:
        return int(self.directions.shape[1])

    @property
    def n_layers(self) -> int:
        """The highest layer any file has a direction for."""
        return int(self.directions.shape[0])

    @property
    def identity(self) -> str:
        """What prompt caches tell control vectors apart by: the summed directions."""
        return hashlib.sha256(self.directions.tobytes()).hexdigest()

    @classmethod
    def load(cls, sources: Iterable[ControlVectorSource]) -> ControlVector:
        """Read and sum control-vector files: paths (strength 1) or (path, strength) pairs.
        A malformed file, or files of different widths, raise InvalidModelError."""
        layers: dict[int, np.ndarray] = {}
        width: int | None = None
        shown: list[tuple[str, float]] = []
        hints: set[str] = set()
        for source in sources:
            path, strength = (source, 1.0) if not isinstance(source, tuple) else source
            path = file_path("a control vector", path)
            strength = _strength(path, strength)
            hint, found = _directions(path)
            if hint is not None:
                hints.add(hint)
            for layer, vector in found:
                if width is not None and vector.size != width:
                    raise InvalidModelError(
                        f"control vector {path} has directions of {vector.size} values; the "
                        f"other files have {width}"
                    )
                width = vector.size
                with np.errstate(over="ignore"):  # checked once the sum is complete
                    scaled = np.float32(strength) * vector
                    layers[layer] = layers.get(layer, np.zeros(width, np.float32)) + scaled
            shown.append((str(path), float(strength)))
        if not shown:
            raise InvalidParameterError("no control-vector files given")
        if width is None:
            raise InvalidModelError(f"no direction.<layer> tensors in {shown[0][0]}")
        directions = np.zeros((max(layers), width), np.float32)
        for layer, vector in layers.items():
            directions[layer - 1] = vector
        if not np.isfinite(directions).all():
            raise InvalidParameterError(
                f"the control vectors' strengths {[s for _, s in shown]} make directions too "
                "large for 32-bit floats"
            )
        if len(hints) > 1:
            raise InvalidModelError(f"control vectors made for different models: {sorted(hints)}")
        return cls(directions, tuple(shown), next(iter(hints), None))

    def check(self, arch: str, n_embd: int, n_layer: int, start: int, end: int) -> None:
        """Raise InvalidParameterError unless this fits a model of architecture ``arch``,
        ``n_embd`` and ``n_layer``, and ``start..end`` (inclusive) are layers of it that can
        hold a direction (1..n_layer)."""
        if self.model_hint is not None and self.model_hint != arch:
            raise InvalidParameterError(
                f"the control vector was made for a {self.model_hint} model; this one is {arch}"
            )
        if self.n_embd != n_embd:
            raise InvalidParameterError(
                f"the control vector has {self.n_embd} values per layer; this model's n_embd "
                f"is {n_embd} (a control vector for another model?)"
            )
        if self.n_layers > n_layer:
            raise InvalidParameterError(
                f"the control vector has a direction for layer {self.n_layers}; this model has "
                f"{n_layer} layers (a control vector for another model?)"
            )
        if not 1 <= start <= end <= n_layer:
            raise InvalidParameterError(
                f"control-vector layer range {start}..{end} is outside this model's layers "
                f"1..{n_layer}"
            )


def _strength(path: Path, strength: object) -> float:
    """A file's strength, checked: a finite real number."""
    if not is_number(strength):
        raise InvalidParameterError(
            f"the strength of control vector {path} must be a number, not {strength!r}"
        )
    if not np.isfinite(strength):
        raise InvalidParameterError(f"the strength of control vector {path} is {strength}")
    return float(strength)


def _directions(path: Path) -> tuple[str | None, list[tuple[int, np.ndarray]]]:
    """The model hint (``controlvector.model_hint``) and the directions of one file."""
    if not path_is(Path.is_file, path, f"control vector {path}"):
        raise InvalidParameterError(f"control vector file not found: {path}")
    metadata, tensors = read_gguf_tensors(path)  # header and tensor bounds checked
    hint = metadata.get("controlvector.model_hint")
    found = []
    for name, dims, ggml_type, offset in tensors:
        prefix, _, index = name.partition(".")
        # Bounded like a model's layers: the directions become one row per layer up to it.
        layer = decimal(index)
        if prefix != "direction" or layer is None or not 1 <= layer <= LLAMA_MAX_LAYERS:
            raise InvalidModelError(
                f"{path}: tensor {name!r} is not a direction.<layer> tensor (layer "
                f"1..{LLAMA_MAX_LAYERS})"
            )
        if ggml_type != _F32 or len(dims) != 1:
            raise InvalidModelError(f"{path}: tensor {name!r} is not a one-dimensional F32 vector")
        vector = np.fromfile(path, dtype="<f4", count=dims[0], offset=offset)
        if not np.isfinite(vector).all():
            raise InvalidModelError(f"{path}: tensor {name!r} holds NaN or infinite values")
        found.append((int(index), vector.astype(np.float32)))
    return hint if isinstance(hint, str) else None, found
