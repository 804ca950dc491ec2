"""llama-cpp-python's sampling keywords, shared by every generating method, as llamacrab's
SamplingOptions fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from llamacrab import InvalidParameterError
from llamacrab._field_types import decimal, is_number
from llamacrab.compat._errors import UnsupportedParameterError
from llamacrab.compat.llama_grammar import LlamaGrammar


@dataclass(frozen=True)
class Sampling:
    """The sampling keywords of one call. The public methods spell them out (their
    signatures are llama-cpp-python's); ``of(locals())`` collects them in one place."""

    temperature: float
    top_p: float
    min_p: float
    typical_p: float
    top_k: int
    frequency_penalty: float
    presence_penalty: float
    repeat_penalty: float
    tfs_z: float
    mirostat_mode: int
    mirostat_tau: float
    mirostat_eta: float
    logit_bias: Mapping[int | str, float] | None
    grammar: LlamaGrammar | str | None

    @classmethod
    def of(cls, call: Mapping[str, Any]) -> Sampling:
        """The keywords among a call's arguments (``locals()`` of the public method)."""
        return cls(**{field.name: call[field.name] for field in fields(cls)})

    def options(self, seed: int, penalty_last_n: int) -> dict[str, Any]:
        """llamacrab SamplingOptions fields for these keywords."""
        if self.tfs_z != 1.0:
            raise UnsupportedParameterError(
                [f"tfs_z={self.tfs_z} (tail-free sampling is no longer part of llama.cpp)"]
            )
        options: dict[str, Any] = {
            "temperature": self.temperature,
            "top_k": max(self.top_k, 0),
            "top_p": min(self.top_p, 1.0),
            "min_p": self.min_p,
            "typical_p": self.typical_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repeat_penalty": self.repeat_penalty,
            "penalty_last_n": penalty_last_n,
            "mirostat": self.mirostat_mode,
            "mirostat_tau": self.mirostat_tau,
            "mirostat_eta": self.mirostat_eta,
            "seed": seed,
        }
        if self.temperature < 0:  # llama-cpp-python: sample the plain distribution, no filters
            options.update(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0)
        if self.logit_bias:
            options["logit_bias"] = _logit_bias(self.logit_bias)
        if isinstance(self.grammar, LlamaGrammar):
            options["grammar"], options["grammar_root"] = self.grammar.grammar, self.grammar.root
        elif self.grammar is not None:
            options["grammar"] = str(self.grammar)
        return options


def _logit_bias(bias: Mapping[int | str, float]) -> dict[int, float]:
    """llama-cpp-python's logit_bias (token ids, as integers or their text) as llamacrab's."""
    converted = {}
    for key, value in bias.items():
        token = decimal(key, signed=True) if isinstance(key, str) else key
        if isinstance(token, bool) or not isinstance(token, int) or not is_number(value):
            raise InvalidParameterError(
                f"logit_bias maps token ids to numbers, not {key!r} to {value!r}"
            )
        converted[token] = float(value)
    return converted
