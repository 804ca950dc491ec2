"""Which LoRA adapters a sequence's KV memory is computed with, position by position: one set
for the whole sequence, or, for an aLoRA adapter (activated LoRA), none before the last
occurrence of its invocation tokens in the prompt and the adapter from there on (so the KV
of a shared prompt prefix is the base model's, reusable by every request)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from llamacrab._exceptions import InvalidParameterError
from llamacrab._native.adapter import LoraAdapter

Adapters = Mapping[LoraAdapter, float]


@dataclass(frozen=True)
class LoraPlan:
    """``adapters`` (scales != 0) apply from position ``start`` on; before it, none."""

    adapters: dict[LoraAdapter, float] = field(default_factory=dict)
    start: int = 0

    def at(self, position: int) -> dict[LoraAdapter, float]:
        """The adapters a token at ``position`` is decoded with."""
        return self.adapters if position >= self.start else {}

    @property
    def base_until(self) -> float:
        """Positions before this one are computed without adapters."""
        return math.inf if not self.adapters else self.start

    def reusable(self, other: LoraPlan) -> float:
        """How many leading positions computed under this plan are valid under ``other``."""
        if self.adapters == other.adapters and self.base_until == other.base_until:
            return math.inf
        return min(self.base_until, other.base_until)


def lora_plan(adapters: Adapters, prompt: Sequence[int]) -> LoraPlan:
    """The plan for ``prompt`` with ``adapters``. When every active adapter is an aLoRA one,
    exactly one may be active; it applies from the last occurrence of its invocation tokens,
    and not at all when the prompt lacks them (as llama-server does). Mixed with plain
    adapters, an aLoRA adapter applies everywhere like them."""
    active = {a: float(s) for a, s in adapters.items() if s != 0}
    if not active or not all(a.alora_invocation_tokens for a in active):
        return LoraPlan(active)
    if len(active) != 1:
        raise InvalidParameterError(
            f"{len(active)} aLoRA adapters requested: an aLoRA adapter runs alone"
        )
    (adapter,) = active
    start = _last_occurrence(prompt, adapter.alora_invocation_tokens)
    return LoraPlan() if start is None else LoraPlan(active, start)


def _last_occurrence(tokens: Sequence[int], needle: Sequence[int]) -> int | None:
    n = len(needle)
    for start in range(len(tokens) - n, -1, -1):
        if list(tokens[start : start + n]) == list(needle):
            return start
    return None
