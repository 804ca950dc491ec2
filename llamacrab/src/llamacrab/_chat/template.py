"""Chat templates rendered with Jinja2 in a sandbox: templates from model files are untrusted.

The immutable sandbox refuses attribute escapes (``__class__``, ``mro`` and the like) and
mutation of the values passed in. Rendering is bounded in output size and time, so a template
that loops forever or grows without end raises TemplateError instead of hanging the process.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llamacrab._exceptions import TemplateError

MAX_OUTPUT_CHARS = 1_000_000
MAX_SECONDS = 2.0


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the chat template refused the messages: {message}")


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox quietly renders an unsafe attribute as undefined; a template reaching for
    Python internals is hostile or broken either way, so it is an error here."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to {attribute!r} of a {type(obj).__name__} is not allowed")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


_ENV = _environment()


class _Deadline:
    """A trace function that stops template code running past its time budget."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > self.deadline:
            raise TemplateError(f"the chat template ran longer than {MAX_SECONDS} s")
        return self


def render(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """The prompt text ``source`` makes of ``messages`` (the usual Hugging Face variables)."""
    try:
        template = _ENV.from_string(source)
    except jinja2.TemplateError as error:
        raise TemplateError(f"the chat template does not parse: {error}") from error
    variables = {
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "tools": list(tools) if tools else None,
        "documents": list(documents) if documents else None,
        **extra,
    }
    pieces: list[str] = []
    size = 0
    previous = sys.gettrace()
    sys.settrace(_Deadline(MAX_SECONDS))
    try:
        for piece in template.generate(**variables):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateError(
                    f"the chat template produced more than {MAX_OUTPUT_CHARS} chars"
                )
            pieces.append(piece)
    except TemplateError:
        raise
    except SecurityError as error:
        raise TemplateError(f"the chat template tried something unsafe: {error}") from error
    except Exception as error:  # a template is code from a file: any failure is its failure
        raise TemplateError(f"the chat template failed: {type(error).__name__}: {error}") from error
    finally:
        sys.settrace(previous)
    return "".join(pieces)
