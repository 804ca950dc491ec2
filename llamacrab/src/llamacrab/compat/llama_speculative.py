"""Draft models for speculative decoding, as llama-cpp-python names them."""

from __future__ import annotations

from typing import Any

from llamacrab import PromptLookup


class LlamaDraftModel:
    """The base class of llama-cpp-python's draft models. llamacrab drafts inside its engine, so
    only the drafters it implements are accepted: LlamaPromptLookupDecoding (and llamacrab's own
    ``PromptLookup`` / ``DraftModel``); a subclass with its own ``__call__`` is refused."""

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        raise NotImplementedError

    def speculative(self) -> PromptLookup:
        raise NotImplementedError


class LlamaPromptLookupDecoding(LlamaDraftModel):
    """Drafts the tokens that followed the latest earlier occurrence of the last
    ``max_ngram_size`` (down to 1) tokens: llamacrab's ``PromptLookup`` with those settings."""

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10) -> None:
        self.max_ngram_size = max_ngram_size
        self.num_pred_tokens = num_pred_tokens

    def speculative(self) -> PromptLookup:
        return PromptLookup(
            max_ngram=self.max_ngram_size, min_ngram=1, max_draft=self.num_pred_tokens
        )


__all__ = ["LlamaDraftModel", "LlamaPromptLookupDecoding"]
