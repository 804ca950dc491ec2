"""llama-server's ``samplers`` field: the samplers of the chain and their order, as names
(with llama.cpp's spellings and aliases) or as one character each."""

from __future__ import annotations

from typing import Any

from llamacrab.server._errors import ApiError

# llama.cpp's canonical names (common/sampling.cpp) -> SamplingOptions.order's names. "infill"
# is a flag there (placed before the final pick), "adaptive_p" the final pick itself.
_CANONICAL = {
    "dry": "dry", "top_k": "top_k", "top_p": "top_p", "top_n_sigma": "top_n_sigma",
    "typ_p": "typical", "min_p": "min_p", "temperature": "temperature", "xtc": "xtc",
    "infill": "infill", "penalties": "penalties", "adaptive_p": "adaptive_p",
}  # fmt: skip
_ALIASES = {"nucleus": "top_p", "temp": "temperature", "typ": "typical"}
_NAMES = {
    **{name.replace("_", "-"): ours for name, ours in _CANONICAL.items()},
    **{name.replace("_", ""): ours for name, ours in _CANONICAL.items()},
    **_ALIASES,
    **_CANONICAL,
}
_CHARS = {"d": "dry", "k": "top_k", "y": "typical", "p": "top_p", "s": "top_n_sigma",
          "m": "min_p", "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties",
          "a": "adaptive_p"}  # fmt: skip


def sampler_order(samplers: list[str] | str) -> dict[str, Any]:
    """The ``order`` and ``infill`` keywords for llama-server's ``samplers``: only the samplers
    named run, in that order, as in llama.cpp's chain."""
    table, names = (_CHARS, list(samplers)) if isinstance(samplers, str) else (_NAMES, samplers)
    unknown = [name for name in names if name.lower() not in table]
    if unknown:
        known = "".join(_CHARS) if isinstance(samplers, str) else ", ".join(_CANONICAL)
        raise ApiError(400, f"unknown samplers {unknown}; known: {known}", param="samplers")
    chosen = [table[name.lower()] for name in names]
    order = tuple(name for name in chosen if name not in ("infill", "adaptive_p"))
    return {"order": order, "infill": "infill" in chosen}
