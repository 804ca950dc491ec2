"""Typed, OpenAI-shaped results of completion calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["length", "eos", "stop", "cancelled", "tool_calls"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class CompletionChoice:
    index: int
    text: str
    finish_reason: FinishReason
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Completion:
    id: str
    created: int
    model: str
    choices: tuple[CompletionChoice, ...]
    usage: Usage

    @property
    def text(self) -> str:
        """The text of the first choice."""
        return self.choices[0].text


@dataclass(frozen=True)
class CompletionChunk:
    """One streamed piece. ``finish_reason`` and ``usage`` are set on the last chunk only."""

    id: str
    created: int
    model: str
    index: int
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    tokens: tuple[int, ...] = ()
