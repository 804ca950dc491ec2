"""A generation's sampling as llama-server describes it, with its field names: the defaults
(``/props``' ``default_generation_settings.params``) and what one request ran with (the
``generation_settings`` of a ``/completion`` answer)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from llamacrab import SamplingOptions
from llamacrab._llama import Llama
from llamacrab.server._schemas import GenerationFields
from llamacrab.server._settings import ServerSettings

# llama-server's sampler names where ours differ.
_SAMPLER_NAMES = {"typical": "typ_p"}
_RANDOM_SEED = 0xFFFFFFFF  # llama-server's LLAMA_DEFAULT_SEED: a random seed per request
# The Python API's keywords whose llama-server name differs.
_NATIVE_NAMES = {"penalty_last_n": "repeat_last_n", "logprobs": "n_probs"}


def default_settings(llama: Llama, settings: ServerSettings) -> dict[str, Any]:
    """The sampling a request gets when it names none."""
    d = SamplingOptions()
    limit = settings.max_tokens_limit
    return {
        "n_predict": limit, "max_tokens": limit,
        "seed": _RANDOM_SEED if llama.seed is None else llama.seed,
        "temperature": d.temperature, "dynatemp_range": d.dynatemp_range,
        "dynatemp_exponent": d.dynatemp_exponent, "top_k": d.top_k, "top_p": d.top_p,
        "min_p": d.min_p, "top_n_sigma": d.top_n_sigma, "xtc_probability": d.xtc_probability,
        "xtc_threshold": d.xtc_threshold, "typical_p": d.typical_p,
        "repeat_last_n": d.penalty_last_n, "repeat_penalty": d.repeat_penalty,
        "presence_penalty": d.presence_penalty, "frequency_penalty": d.frequency_penalty,
        "dry_multiplier": d.dry_multiplier, "dry_base": d.dry_base,
        "dry_allowed_length": d.dry_allowed_length, "dry_penalty_last_n": d.dry_penalty_last_n,
        "dry_sequence_breakers": list(d.dry_sequence_breakers), "mirostat": d.mirostat,
        "mirostat_tau": d.mirostat_tau, "mirostat_eta": d.mirostat_eta, "stop": [],
        "n_keep": 0, "ignore_eos": False, "stream": False, "n_probs": 0, "min_keep": 0,
        "grammar": "", "samplers": _sampler_names(d.order), "timings_per_token": False,
    }  # fmt: skip


def used_settings(
    llama: Llama, settings: ServerSettings, kwargs: Mapping[str, Any], body: GenerationFields
) -> dict[str, Any]:
    """The sampling a request (``body``) ran with: the defaults, with what its keywords for
    the Python API (``kwargs``) set, and ``logit_bias`` as llama-server lists it (a ban's bias
    is null: JSON has no infinity, and llama-server's JSON writes it so)."""
    used = default_settings(llama, settings)
    for key, value in kwargs.items():
        name = _NATIVE_NAMES.get(key, key)
        if name in used:
            used[name] = list(value) if isinstance(value, tuple | list) else value
    if "max_tokens" in kwargs:
        used["n_predict"] = kwargs["max_tokens"]
    if "order" in kwargs:
        used["samplers"] = _sampler_names(kwargs["order"])
    bias = kwargs.get("logit_bias") or {}
    used["logit_bias"] = [{"bias": b if math.isfinite(b) else None, "token": token}
                          for token, b in bias.items()]  # fmt: skip
    used.update(stream=body.stream, ignore_eos=body.ignore_eos,
                timings_per_token=body.timings_per_token)  # fmt: skip
    return used


def _sampler_names(order: Sequence[str]) -> list[str]:
    return [_SAMPLER_NAMES.get(name, name) for name in order]
