"""Chat templates rendered with Jinja2 in a sandbox: templates from model files are untrusted.

The immutable sandbox refuses attribute escapes (``__class__``, ``mro`` and the like) and
mutation of the values passed in. Rendering is bounded in output size and time, so a template
that loops forever or grows without end raises TemplateError instead of hanging the process.

The time limit cannot stop one C-level operation, so the operations that build a value in one
step are bounded before they run: string and list repetition and concatenation (``*``, ``+``),
``%`` formatting widths, integer ``**`` and ``*``, the ``join``, ``replace``, ``center``,
``indent``, ``format`` and ``sum`` filters and the string methods that pad, join or replace.
``range`` is bounded by Jinja's sandbox (``jinja2.sandbox.MAX_RANGE``).
"""

from __future__ import annotations

import datetime
import json
import re
import sys
import time
from collections.abc import Mapping, Sequence
from types import BuiltinFunctionType, FrameType
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.filters import FILTERS
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llamacrab._exceptions import TemplateError

MAX_OUTPUT_CHARS = 1_000_000
MAX_SECONDS = 2.0
# The largest string (characters) or list (items, counting the characters of the strings in
# it) one template operation may build, and the largest integer (bits) ``*`` or ``**`` may.
MAX_VALUE_SIZE = 1_000_000
MAX_INT_BITS = 10_000


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the chat template refused the messages: {message}")


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _size(value: Any) -> int:
    """Characters of a string; items of a list or tuple plus the characters of the strings in
    it (a list of one long string repeated is as large as the string repeated); else 1."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        total = len(value)
        for item in value:
            total += len(item) if isinstance(item, (str, list, tuple)) else 0
            if total > MAX_VALUE_SIZE:
                break
        return total
    return 1


def _refuse_size(size: int, what: str) -> None:
    if size > MAX_VALUE_SIZE:
        raise TemplateError(
            f"the chat template built {what} of about {size} characters or items, over the limit "
            f"of {MAX_VALUE_SIZE} (llamacrab._chat.template.MAX_VALUE_SIZE)"
        )


def _refuse_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateError(
            f"the chat template computed an integer of about {bits} bits, over the limit of "
            f"{MAX_INT_BITS} bits (llamacrab._chat.template.MAX_INT_BITS)"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int)


_SEQUENCE = (str, list, tuple)
# A %-conversion's width and precision: digits, or * (taken from the arguments).
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent(template: str, args: Any) -> None:
    """Widths and precisions in ``template % args``: ``'%999999999d' % 1`` is a gigabyte."""
    star = False
    for width, precision in _PERCENT_SPEC.findall(template):
        for number in (width, precision):
            star = star or number == "*"
            if number.isdigit():
                _refuse_size(int(number), "a formatted field")
    if star:
        values = args if isinstance(args, tuple) else (args,)
        for value in values:
            if _is_int(value):
                _refuse_size(abs(value), "a formatted field")


def _check_binop(op: str, left: Any, right: Any) -> None:
    if op == "*":
        if _is_int(left) and _is_int(right):
            _refuse_bits(abs(left).bit_length() + abs(right).bit_length())
        elif isinstance(left, _SEQUENCE) and _is_int(right):
            _refuse_size(_size(left) * max(right, 0), "a repeated sequence")
        elif _is_int(left) and isinstance(right, _SEQUENCE):
            _refuse_size(_size(right) * max(left, 0), "a repeated sequence")
    elif op == "+":
        if isinstance(left, _SEQUENCE) and isinstance(right, _SEQUENCE):
            _refuse_size(_size(left) + _size(right), "a concatenation")
    elif op == "**":
        if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            _refuse_bits(abs(left).bit_length() * right)
    elif op == "%" and isinstance(left, str):
        _check_percent(left, right)


def _checked_join(sequence: Any, separator: str) -> None:
    items = list(sequence)
    _refuse_size(sum(_size(i) for i in items) + len(separator) * len(items), "a joined string")


def _checked_replace(value: Any, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(value, str) and isinstance(old, str) and isinstance(new, str):
        found = value.count(old) if old else len(value) + 1
        if _is_int(count) and count >= 0:
            found = min(found, count)
        _refuse_size(len(value) + found * max(len(new) - len(old), 0), "a replaced string")


def _guard_filters(env: jinja2.Environment) -> None:
    """The filters that build a large value in one step, with a size check first."""

    def join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
        items = list(value)
        if attribute is None:
            _checked_join(items, str(d))
        joined: str = FILTERS["join"](eval_ctx, items, d, attribute)
        return joined

    def replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> str:
        _checked_replace(str(s), str(old), str(new), -1 if count is None else count)
        replaced: str = FILTERS["replace"](eval_ctx, s, old, new, count)
        return replaced

    def center(value: Any, width: int = 80) -> str:
        if _is_int(width):
            _refuse_size(width, "a centred string")
        return str(FILTERS["center"](value, width))

    def indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> str:
        lines = str(s).count("\n") + 1
        each = width if _is_int(width) else len(str(width))
        _refuse_size(len(str(s)) + lines * each, "an indented string")
        return str(FILTERS["indent"](s, width, first, blank))

    def format_(value: Any, *args: Any, **kwargs: Any) -> str:
        _check_percent(str(value), kwargs or args)
        return str(FILTERS["format"](value, *args, **kwargs))

    def sum_(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
        items = list(iterable)
        if isinstance(start, _SEQUENCE):
            _refuse_size(_size(start) + sum(_size(i) for i in items), "a sum")
        return FILTERS["sum"](environment, items, attribute, start)

    for name, function in (("replace", replace), ("join", join)):
        setattr(function, "jinja_pass_arg", FILTERS[name].jinja_pass_arg)  # noqa: B010
    setattr(sum_, "jinja_pass_arg", FILTERS["sum"].jinja_pass_arg)  # noqa: B010
    env.filters.update(join=join, replace=replace, center=center, indent=indent,
                       format=format_, sum=sum_)  # fmt: skip


def _check_str_method(method: BuiltinFunctionType, args: tuple[Any, ...]) -> None:
    """``'x'.ljust(10**9)`` and the like, refused before they run."""
    target, name = method.__self__, method.__name__
    if not isinstance(target, str) or not args:
        return
    if name in ("ljust", "rjust", "center", "zfill") and _is_int(args[0]):
        _refuse_size(args[0], "a padded string")
    elif name == "expandtabs" and _is_int(args[0]):
        _refuse_size(len(target) + target.count("\t") * max(args[0], 0), "an expanded string")
    elif name == "join":
        _checked_join(args[0], target)
    elif name == "replace" and len(args) >= 2:
        _checked_replace(target, args[0], args[1], args[2] if len(args) > 2 else -1)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox quietly renders an unsafe attribute as undefined; a template reaching for
    Python internals is hostile or broken either way, so it is an error here. Operators that
    can build a huge value in one step are checked first (see the module's docstring)."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to {attribute!r} of a {type(obj).__name__} is not allowed")

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(__obj, BuiltinFunctionType) and isinstance(__obj.__self__, str):
            if __obj.__name__ == "join" and args:
                args = (list(args[0]), *args[1:])  # an iterator is read once: check a list
            _check_str_method(__obj, args)
        return super().call(__context, __obj, *args, **kwargs)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    _guard_filters(env)
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
