"""A case run on a Llama kept across the cases: the Llama must answer afterwards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def then_still_answers(llm: Any, attempt: Callable[[], str], what: str) -> tuple[str, str]:
    """``("ok", attempt())``, or the LlamaError it raised (the expected refusal) raised again,
    once ``llm`` has answered a plain prompt after it; a failure there is the Llama itself
    broken by ``what``, not a refusal: a RuntimeError (unclean)."""
    from llamacrab import LlamaError

    refusal, detail = None, ""
    try:
        detail = attempt()
    except LlamaError as error:
        refusal = error
    try:
        llm.create_completion("plain words", max_tokens=1, temperature=0)
    except LlamaError as error:
        raise RuntimeError(f"the Llama failed after the {what}: {error}") from error
    if refusal is not None:
        raise refusal
    return "ok", detail
