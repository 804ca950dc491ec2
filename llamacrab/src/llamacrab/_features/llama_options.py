"""Keyword options of ``Llama(...)`` that name files and sizes instead of objects: LoRA
adapters, control vectors, a draft model, prompt lookup and a prompt cache. Plain values (a
command line, a TOML file) reach every feature this way; the facade turns them into objects."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from llamacrab._engine.cache import DiskCache, PromptCache, RamCache
from llamacrab._engine.speculative import PromptLookup
from llamacrab._exceptions import InvalidParameterError
from llamacrab._field_types import check_field_types
from llamacrab._native.control_vector import ControlVector, ControlVectorSource

Path = str | os.PathLike[str]
ScaledPath = Path | tuple[Path, float]


@dataclass(frozen=True, kw_only=True)
class ExtraOptions:
    """``lora``: adapter files (or (file, scale) pairs), loaded in order and applied.
    ``control_vectors``: control-vector files (or (file, strength) pairs), summed and applied
    to ``control_vector_layers`` (first, last; default every layer). ``draft_model``: a
    smaller model of the same vocabulary drafting up to ``draft_max`` tokens
    (``draft_n_gpu_layers`` offloaded); ``prompt_lookup``: n-gram drafting with this largest
    n-gram instead. ``prompt_cache``: "ram" or a directory, at most ``prompt_cache_bytes``."""

    lora: Sequence[ScaledPath] = ()
    control_vectors: Sequence[ControlVectorSource] = ()
    control_vector_layers: tuple[int, int] | None = None
    draft_model: Path | None = None
    draft_max: int | None = None
    draft_n_gpu_layers: int | None = None
    prompt_lookup: int | None = None
    prompt_cache: Path | None = None
    prompt_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        for name, each in (("lora", "scale"), ("control_vectors", "strength")):
            for item in getattr(self, name) if isinstance(getattr(self, name), tuple) else ():
                file = item[0] if isinstance(item, tuple) and len(item) == 2 else item
                if not isinstance(file, str | os.PathLike):
                    raise InvalidParameterError(
                        f"{name} holds files or (file, {each}) pairs, not {item!r}"
                    )
        check_field_types(self)  # (after the items: their own message says more)
        if self.draft_model is not None and self.prompt_lookup is not None:
            raise InvalidParameterError("choose draft_model or prompt_lookup, not both")
        if self.draft_max is not None and self.draft_max < 1:
            raise InvalidParameterError(f"draft_max must be >= 1, not {self.draft_max}")
        if self.prompt_cache_bytes is not None and self.prompt_cache is None:
            raise InvalidParameterError("prompt_cache_bytes needs prompt_cache ('ram' or a dir)")
        if self.control_vector_layers is not None and not self.control_vectors:
            raise InvalidParameterError("control_vector_layers needs control_vectors")
        if self.control_vector_layers is not None and len(self.control_vector_layers) != 2:
            raise InvalidParameterError("control_vector_layers is (first, last)")

    @property
    def speculative(self) -> bool:
        return self.draft_model is not None or self.prompt_lookup is not None

    def lookup(self) -> PromptLookup | None:
        if self.prompt_lookup is None:
            return None
        n = self.prompt_lookup
        return PromptLookup(max_ngram=n, min_ngram=min(n, 1), max_draft=self.draft_max or 32)

    def cache(self) -> PromptCache | None:
        if self.prompt_cache is None:
            return None
        size = self.prompt_cache_bytes
        if os.fspath(self.prompt_cache) == "ram":
            return RamCache() if size is None else RamCache(size)
        directory = os.fspath(self.prompt_cache)
        return DiskCache(directory) if size is None else DiskCache(directory, size)

    def scaled_lora(self) -> list[tuple[Path, float]]:
        return [item if isinstance(item, tuple) else (item, 1.0) for item in self.lora]

    def control_vector(self) -> ControlVector | None:
        return ControlVector.load(self.control_vectors) if self.control_vectors else None


EXTRA_NAMES = frozenset(f.name for f in fields(ExtraOptions))


def take_extra_options(options: dict[str, Any]) -> ExtraOptions:
    """Remove the ExtraOptions keywords from ``options`` and return them."""
    found = {name: options.pop(name) for name in list(options) if name in EXTRA_NAMES}
    for name in ("lora", "control_vectors"):
        value = found.get(name)
        if isinstance(value, str | os.PathLike):
            found[name] = (value,)  # one file
        elif isinstance(value, list | tuple):  # (anything else: ExtraOptions refuses it)
            found[name] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
    if isinstance(found.get("control_vector_layers"), list):
        found["control_vector_layers"] = tuple(found["control_vector_layers"])
    return ExtraOptions(**found)
