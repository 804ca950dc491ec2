"""The error for a missing optional extra (the web stack, Ray), naming the pip command."""

from __future__ import annotations

from llamacrab._exceptions import LlamaError


class MissingExtraError(LlamaError):
    """An optional extra's dependencies are not installed."""
