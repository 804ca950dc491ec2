"""llama-cpp-python's ``Llama(path, vocab_only=True)``: the model's vocabulary alone, to tokenize
and count tokens with, no weights and no context."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import llamacrab
from llamacrab import Context, ContextError, ContextParams, ModelParams


class VocabOnly:
    """What the compat ``Llama`` works with in place of a ``llamacrab.Llama`` when made with
    ``vocab_only=True``: tokenizing works (and holds no tokens); anything that would run the
    model raises ContextError naming what was asked."""

    def __init__(self, model: llamacrab.Model) -> None:
        self.model = model

    @classmethod
    def load(cls, path: str | os.PathLike[str], native: Mapping[str, Any]) -> VocabOnly:
        """The vocabulary of ``path``; ``native``: what llamacrab.Llama would have been given,
        whose model settings are checked as they would be."""
        asked = {name: native[name] for name in _MODEL_FIELDS if name in native}
        return cls(llamacrab.Model.load(path, ModelParams(**asked, vocab_only=True)))

    @property
    def vocab(self) -> llamacrab.Vocab:
        return self.model.vocab

    def tokenize(
        self, text: str | bytes, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        return self.model.vocab.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return self.model.vocab.detokenize(tokens, special)

    def held_tokens(self, *, slot: int = 0) -> list[int]:
        return []  # nothing was ever decoded

    def reset(self) -> None:
        """Nothing to forget."""

    def close(self) -> None:
        self.model.close()

    @property
    def closed(self) -> bool:
        return self.model.closed

    def __getattr__(self, name: str) -> Any:
        # Only names this class lacks: what a llamacrab.Llama has to run the model. Python's
        # own protocols (copy, pickle, hasattr of a dunder) still get their AttributeError.
        if name.startswith("__"):
            raise AttributeError(name)
        raise ContextError(
            f"this Llama was made with vocab_only=True: it holds the model's vocabulary alone, "
            f"and running the model (llamacrab.Llama.{name}) needs its weights and a context"
        )


@dataclass(frozen=True)
class ContextSizes:
    """What the compat ``Llama`` reports of its context (``context_params``, ``n_batch``, ...)."""

    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    n_threads: int
    n_threads_batch: int
    swa_full: bool
    flash_attn: str
    type_k: str
    type_v: str

    @classmethod
    def of(cls, context: Context) -> ContextSizes:
        """A context's own."""
        params = context.params
        return cls(
            n_ctx=context.n_ctx,
            n_batch=context.n_batch,
            n_ubatch=context.n_ubatch,
            n_seq_max=params.n_seq_max,
            n_threads=context.n_threads,
            n_threads_batch=context.n_threads_batch,
            swa_full=params.swa_full,
            flash_attn=params.flash_attn,
            type_k=params.type_k,
            type_v=params.type_v,
        )

    @classmethod
    def asked(
        cls, n_ctx: int, n_batch: int, n_ubatch: int, native: Mapping[str, Any]
    ) -> ContextSizes:
        """What a context made with these settings would have, for a Llama that has none."""
        # Checked as a context made with them would check them.
        batch = min(n_ctx, n_batch)
        params = ContextParams(
            n_ctx=n_ctx,
            n_batch=batch,
            n_ubatch=min(batch, n_ubatch),
            **{name: value for name, value in native.items() if name not in _MODEL_FIELDS},
        )
        # Nothing computes: llama-cpp-python's own default, which it reports the same way.
        threads = params.n_threads or max((os.cpu_count() or 1) // 2, 1)
        return cls(
            n_ctx=n_ctx,
            n_batch=params.n_batch,
            n_ubatch=params.n_ubatch,
            n_seq_max=params.n_seq_max,
            n_threads=threads,
            n_threads_batch=params.n_threads_batch or threads,
            swa_full=params.swa_full,
            flash_attn=params.flash_attn,
            type_k=params.type_k,
            type_v=params.type_v,
        )


_MODEL_FIELDS = frozenset(field.name for field in fields(ModelParams))
