"""Speculative decoding: cheap drafts of the next tokens, verified by the target in one decode.

A drafter proposes tokens; the target decodes the sampled token and the drafts in one batch and
samples at every position. A draft is kept while it equals what the target samples there, so the
output is what plain decoding samples (llama.cpp's rule; it preserves the distribution at any
temperature); the KV memory is rolled back past the first mismatch. On a CPU a longer batch is
not free, so drafting adapts to measured time: it pauses whenever verifying costs more per token
than plain decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from llamacrab._exceptions import InvalidParameterError
from llamacrab._field_types import check_field_types

if TYPE_CHECKING:
    from llamacrab._native.context import Context
    from llamacrab._native.model import Model
    from llamacrab._types import Completion


@dataclass
class SpeculativeStats:
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Drafter(Protocol):
    def draft(self, history: Sequence[int], limit: int) -> list[int]:
        """At most ``limit`` guesses of the tokens after ``history``: the prompt and the output
        so far, a negative id (MEDIA_TOKEN) at each position an image or sound fills."""
        ...

    def feedback(self, drafted: int, accepted: int, seconds: float) -> None: ...

    def plain(self, seconds: float) -> None: ...


@runtime_checkable
class Speculative(Protocol):
    """What ``speculative=`` takes: PromptLookup, DraftModel, or any object that makes a
    Drafter for the target model (checked by that method's presence)."""

    def drafter(self, target: Model) -> Drafter: ...


class _Budget:
    """How many tokens to draft next, judged by measured time: a verification that yields
    fewer tokens per second than plain decoding pauses drafting (longer after each loss), so a
    run where drafts fail stays close to plain speed. Draft length follows acceptance."""

    def __init__(self, max_draft: int, start: int) -> None:
        self.max_draft = max_draft
        self.size = start
        self.pause = 4  # measure plain decoding first
        self.backoff = 16
        self.misses = 0  # verifications in a row that accepted nothing
        self.plain_seconds: float | None = None  # per token, moving average

    def take(self) -> int:
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.size

    def plain(self, seconds: float) -> None:
        previous = self.plain_seconds
        self.plain_seconds = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def update(self, drafted: int, accepted: int, seconds: float) -> None:
        per_token = seconds / (accepted + 1)  # the verification also yields the next token
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= 3:
            self.pause = 1 << 30  # drafts never land here: off for the rest of the generation
        elif self.plain_seconds is not None and per_token > self.plain_seconds:
            self.pause, self.backoff = self.backoff, min(self.backoff * 4, 1024)
        else:
            self.backoff = 16
        # Small batches cost almost as much as one token on a CPU: keep drafts long while they
        # are mostly accepted, shorter when they are not.
        if accepted == drafted:
            self.size = min(self.max_draft, self.size * 2)
        else:
            self.size = min(self.max_draft, max(4, 2 * accepted))


@dataclass(frozen=True, kw_only=True)
class PromptLookup:
    """Drafts by n-gram lookup: the tokens that followed the latest earlier occurrence of the
    last ``max_ngram``..``min_ngram`` tokens (prompt and output alike). Free to compute; pays
    off when the output copies from the prompt (code edits, quotes, extraction)."""

    max_ngram: int = 3
    min_ngram: int = 1
    max_draft: int = 32

    def __post_init__(self) -> None:
        check_field_types(self)
        if not 1 <= self.min_ngram <= self.max_ngram or self.max_draft < 1:
            raise InvalidParameterError(f"invalid prompt-lookup settings: {self}")

    def drafter(self, target: Model) -> Drafter:
        return _LookupDrafter(self)


class _LookupDrafter:
    def __init__(self, options: PromptLookup) -> None:
        self.options = options
        self.budget = _Budget(options.max_draft, start=options.max_draft)  # drafting is free

    def draft(self, history: Sequence[int], limit: int) -> list[int]:
        size = min(self.budget.take(), limit)
        if size <= 0:
            return []
        tokens = np.asarray(history, dtype=np.int64)
        # Only n-grams shorter than the history can occur in it earlier (a huge max_ngram
        # walked every impossible length, each draft).
        longest = min(self.options.max_ngram, len(tokens) - 1)
        for n in range(longest, self.options.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # right after the latest earlier occurrence
                draft = tokens[start : start + size]
                media = np.flatnonzero(draft < 0)  # what follows there is no text: stop before
                cut: list[int] = draft[: media[0] if media.size else size].tolist()
                return cut
        return []

    def feedback(self, drafted: int, accepted: int, seconds: float) -> None:
        self.budget.update(drafted, accepted, seconds)

    def plain(self, seconds: float) -> None:
        self.budget.plain(seconds)


class DraftLlama(Protocol):
    """What drafting needs of the smaller model: a ``Llama`` has it. Drafting asks it for
    greedy completions, whose own prompt reuse keeps its memory in step with the history."""

    model: Model
    context: Context

    def create_completion(self, prompt: Sequence[int], **kwargs: Any) -> Completion: ...


@dataclass(frozen=True, kw_only=True)
class DraftModel:
    """Drafts with a smaller model sharing the target's vocabulary (checked), greedily."""

    llama: DraftLlama
    max_draft: int = 8

    def drafter(self, target: Model) -> Drafter:
        if self.llama.model is target:
            # Its drafts would be a newer generation of the same engine, which supersedes
            # (cancels) the one it drafts for; and the same model drafts at no gain.
            raise InvalidParameterError(
                "the draft model is the model it drafts for: draft with a smaller model, or "
                "with PromptLookup"
            )
        if self.llama.model.encoder_decoder:
            raise InvalidParameterError(
                "the draft model is an encoder-decoder model: its decoder would draft from its "
                "encoder's reading of the text so far, encoded again for every draft"
            )
        check_vocabularies(target, self.llama.model)
        return _ModelDrafter(self)


class _ModelDrafter:
    def __init__(self, options: DraftModel) -> None:
        self.options = options
        # Each draft token costs a decode of the draft model: start with one, grow on success.
        self.budget = _Budget(options.max_draft, start=1)

    def draft(self, history: Sequence[int], limit: int) -> list[int]:
        # The draft model takes no images or sounds: it drafts from the text after the last.
        history = text_after_media(history)
        size = min(self.budget.take(), limit, self.options.llama.context.n_ctx - len(history) - 1)
        if size <= 0:
            return []
        # The draft Llama's own prompt reuse keeps its memory in step with the history.
        result = self.options.llama.create_completion(history, max_tokens=size, temperature=0)
        return list(result.choices[0].tokens)

    def feedback(self, drafted: int, accepted: int, seconds: float) -> None:
        self.budget.update(drafted, accepted, seconds)

    def plain(self, seconds: float) -> None:
        self.budget.plain(seconds)


def text_after_media(history: Sequence[int]) -> list[int]:
    """The tokens after the last image or sound (negative ids) of ``history``; all of it if none.
    Its last token is text: a generation goes on from text."""
    tokens = np.asarray(history, dtype=np.int64)
    media = np.flatnonzero(tokens < 0)
    rest: list[int] = tokens[media[-1] + 1 if media.size else 0 :].tolist()
    return rest


def check_vocabularies(target: Model, draft: Model) -> None:
    """A draft model must tokenize exactly as the target: same size, specials and pieces."""
    a, b = target.vocab, draft.vocab
    if a.n_tokens != b.n_tokens or (a.bos, a.eos) != (b.bos, b.eos):
        raise InvalidParameterError(
            f"the draft model's vocabulary ({b.n_tokens} tokens) differs from the target's "
            f"({a.n_tokens})"
        )
    step = max(1, a.n_tokens // 512)
    for token in range(0, a.n_tokens, step):
        if a.token_to_bytes(token, special=True) != b.token_to_bytes(token, special=True):
            raise InvalidParameterError(
                f"the draft model's token {token} differs from the target's"
            )
