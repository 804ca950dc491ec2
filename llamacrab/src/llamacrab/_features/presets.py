"""Named presets over ModelParams / ContextParams: keyword options a ``Llama`` (or a registry
entry, or ``--preset``) starts from; options given explicitly override them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from llamacrab._exceptions import InvalidParameterError


@dataclass(frozen=True)
class Preset:
    """A named set of ``Llama`` keyword options, and why each is set."""

    name: str
    options: Mapping[str, Any]
    why: str


PRESETS: Mapping[str, Preset] = MappingProxyType({
    "low-ram": Preset("low-ram", MappingProxyType({
        "n_ctx": 2048, "n_batch": 512, "n_ubatch": 128, "type_k": "q8_0", "type_v": "q8_0",
        "flash_attn": "on", "swa_full": False, "use_mmap": True, "use_extra_bufts": False,
        "ctx_checkpoints": 1,
    }), "the compute buffer holds n_ubatch x vocabulary logits (128 MiB at n_ubatch 512 for a "
        "64k vocabulary), so a small n_ubatch shrinks it most; a q8_0 KV memory is half of f16 "
        "(quantized V needs flash attention); sliding-window layers keep only their window, "
        "and one checkpoint of it; mapped weights stay shareable page cache, and no repacked "
        "copies are made"),
    "balanced": Preset("balanced", MappingProxyType({
        "n_ctx": 4096, "n_batch": 2048, "n_ubatch": 512, "n_gpu_layers": -1,
        "flash_attn": "auto", "type_k": "f16", "type_v": "f16", "use_mmap": True,
    }), "llama.cpp's defaults with a 4096-token context: every layer a GPU can hold is "
        "offloaded, flash attention where the backend has it, an exact f16 KV memory"),
    "max-gpu": Preset("max-gpu", MappingProxyType({
        "n_ctx": 8192, "n_batch": 2048, "n_ubatch": 1024, "n_gpu_layers": -1,
        "offload_kqv": True, "flash_attn": "on", "type_k": "f16", "type_v": "f16",
        "use_mmap": False,
    }), "everything on the GPU: all layers and the KV memory offloaded, flash attention, a "
        "larger micro-batch for faster prompts; weights are read, not mapped, so no host "
        "mapping of the file stays behind"),
})  # fmt: skip


def with_preset(name: str | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` over the preset ``name``'s (None: ``options`` alone)."""
    if name is None:
        return dict(options)
    preset = PRESETS.get(name)
    if preset is None:
        raise InvalidParameterError(f"unknown preset {name!r}; one of {sorted(PRESETS)}")
    return {**preset.options, **options}
