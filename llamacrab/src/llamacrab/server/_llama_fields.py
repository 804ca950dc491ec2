"""llama-server's generation fields that need the model or take time, read alike on every
generation route: ``logit_bias`` in its forms and ``ignore_eos`` (the vocabulary), and
``json_schema`` (a grammar made of it). Run off the event loop."""

from __future__ import annotations

import math
from typing import Any

from llamacrab import schema_to_grammar
from llamacrab._exceptions import LlamaError
from llamacrab._field_types import decimal
from llamacrab._llama import Llama
from llamacrab.server._errors import ApiError
from llamacrab.server._schemas import GenerationFields

_C_WHITESPACE = " \t\n\v\f\r"  # C's isspace, which strtol skips


def completion_fields(body: GenerationFields, llama: Llama) -> dict[str, Any]:
    """The keywords of these fields on a completion route (a chat reads ``json_schema`` as a
    ``response_format``)."""
    return {**token_kwargs(body, llama), **schema_kwargs(body)}


def token_kwargs(body: GenerationFields, llama: Llama) -> dict[str, Any]:
    """``logit_bias`` as token ids, with every end-of-generation token banned for
    ``ignore_eos`` (over any bias given to it, as llama-server adds its bans after)."""
    bias = logit_bias(llama, body.logit_bias)
    if body.ignore_eos:
        bias.update(dict.fromkeys(llama.vocab.eog_tokens, -math.inf))
    return {"logit_bias": bias} if bias else {}


def logit_bias(
    llama: Llama, bias: dict[str, float | bool] | list[tuple[str | int, float | bool]] | None
) -> dict[int, float]:
    """llama-server's forms: ``{"id": bias}`` or ``[[id or text, bias]]``; ``false`` bans the
    token; text stands for each of its tokens (``[["15", 1]]`` is the text "15", as there).
    An id outside the vocabulary is refused (where llama-server drops it)."""
    # An object's keys are ids where strtol reads one, a list's texts are always text.
    keyed = isinstance(bias, dict)
    pairs = list(bias.items()) if isinstance(bias, dict) else bias or []
    out: dict[int, float] = {}
    for key, value in pairs:
        amount = -math.inf if value is False else float(value)
        if isinstance(key, int):
            out[key] = amount
        elif keyed and (token := _token_id(key)) is not None:
            out[token] = amount
        else:
            for token in llama.tokenize(key, add_special=False):
                out[token] = amount
    try:
        llama.vocab.check_tokens(list(out))
    except LlamaError as error:
        raise ApiError(400, f"logit_bias: {error}", param="logit_bias") from error
    return out


def _token_id(key: str) -> int | None:
    """The token id a text key spells as llama-server's ``strtol`` reads it: leading C
    whitespace, a sign, then ASCII digits to the end (" 15" and "+15" are 15, "15 " is text);
    None for text."""
    number = key.lstrip(_C_WHITESPACE)
    sign = number[:1] if number[:1] in ("+", "-") else ""
    digits = decimal(number[len(sign) :])
    return None if digits is None else -digits if sign == "-" else digits


def schema_kwargs(body: GenerationFields) -> dict[str, Any]:
    """The grammar of ``json_schema`` ({} is any object), unless a grammar is given too: that
    one wins, as in llama-server."""
    if body.json_schema is None or body.grammar is not None:
        return {}
    try:
        return {"grammar": schema_to_grammar(body.json_schema or {"type": "object"})}
    except LlamaError as error:
        raise ApiError(400, f"json_schema: {error}", param="json_schema") from error
