"""Options checked before they reach C: integers against the C fields' ranges
(``check_range``), options dataclasses against their own annotations (``check_field_types``)
and a function's arguments against its annotations (``check_arguments``, for APIs that take
plain keywords), so that a value of another type (a list for a float, text for an integer,
None where a number is required) or past a C type is an InvalidParameterError naming the
field, not a TypeError from a comparison further on or an OverflowError from cffi.

Simple annotations are checked: int, float (an int too), bool (0 and 1 too), str, None, their
unions, Literal, and containers by kind (a tuple or list, whose items are checked against
``tuple[X, ...]`` / ``Sequence[X]``; a mapping, a TypedDict too). A path may be text; any other
class is an isinstance check; what cannot be resolved is left alone.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard, TypeVar, cast

import numpy as np

from llamacrab._exceptions import InvalidParameterError, LlamaError

INT32_MIN, INT32_MAX, UINT32_MAX = -(2**31), 2**31 - 1, 2**32 - 1
# The highest position a token may take. llama.cpp computes past a token's position in int32:
# each sequence's next position (last + 1) at every decode, and how far back the attention
# mask looks (position + 32 + the sliding window, llama-kv-cache.cpp), which overflowed within
# 33 of INT32_MAX (undefined behaviour; three tokens decoded together or one at a time differed
# by 0.47 in a logit). 2^24 of room covers windows of 16.7 million positions.
LAST_POSITION = INT32_MAX - 2**24
FLOAT32_MAX = 3.4028234663852886e38  # past it a C float is infinite
_Function = TypeVar("_Function", bound=Callable[..., Any])


def check_range(name: str, value: int | None, low: int, high: int) -> None:
    """Raise InvalidParameterError unless ``value`` (None: llama.cpp's default) is an integer in
    low..high: a C field's range at most, which cffi would otherwise answer with an
    OverflowError or a TypeError."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | np.integer)
        or not low <= value <= high
    ):
        raise InvalidParameterError(f"{name} must be an integer in {low}..{high}, not {value!r}")


def utf8(text: str, what: str, error: type[LlamaError] = InvalidParameterError) -> bytes:
    """``text`` in UTF-8, or ``error`` naming ``what``: a str can hold a lone surrogate (JSON's
    "\\ud800", a file name decoded with surrogateescape), which has no UTF-8."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(f"{what} is not valid Unicode: {_surrogate(text, exc)}") from None


def _surrogate(text: str, exc: UnicodeEncodeError) -> str:
    return f"an unpaired surrogate {text[exc.start]!r} at character {exc.start}"


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``stop`` (one string, several, or None for none) as a tuple of strings that can end a
    generation. Refused: an empty one, which would match before any text, and one holding an
    unpaired surrogate, which no generated text can (it is decoded from UTF-8, which cannot
    encode one)."""
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    for text in stops:
        if not isinstance(text, str):
            raise InvalidParameterError(f"stop strings are text, not {_shown(text)}")
        if not text:
            raise InvalidParameterError(
                "an empty stop string would match before any text: a stop string needs at "
                "least one character"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidParameterError(
                f"the stop string {text!r} holds {_surrogate(text, exc)}, which UTF-8 cannot "
                "encode: no generated text can match it"
            ) from None
    return stops


def choice_seeds(seed: int | None, count: int) -> list[int | None]:
    """The seeds of ``count`` choices drawn for one request: ``seed``, then one more for each
    choice after the first (wrapping at 32 bits), so that choice i is the same whether it is
    generated alone or among others; None draws a seed for each."""
    return [None if seed is None else (seed + i) % 2**32 for i in range(count)]


def file_path(what: str, path: object) -> Path:
    """``path`` (text or os.PathLike) as a Path; InvalidParameterError naming ``what`` for
    anything else or a NUL inside (which no file name holds), not a TypeError or ValueError
    from pathlib or ``open``."""
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else None
    if not isinstance(text, str) or "\0" in text:
        raise InvalidParameterError(f"{what} must be a file path (text or os.PathLike without "
                                    f"NUL), not {_shown(path)}")  # fmt: skip
    return Path(text)


def path_is(test: Callable[[Path], bool], path: Path, what: str) -> bool:
    """``test(path)`` (``Path.exists``, ``Path.is_file``); an OSError it lets through (a name
    too long) is an InvalidParameterError naming ``what``."""
    try:
        return test(path)
    except OSError as error:
        raise InvalidParameterError(f"{what}: {error.strerror}") from None


def decimal(text: str, signed: bool = False) -> int | None:
    """The integer ``text`` spells in ASCII digits (a leading "-" with ``signed``), else None.
    ``str.isdigit`` is also true of "²" and "٣", which ``int`` refuses or reads as 3."""
    body = text[1:] if signed and text.startswith("-") else text
    return int(text) if body.isascii() and body.isdigit() else None


def is_number(value: object) -> TypeGuard[int | float | np.integer | np.floating]:
    """A real number as C takes one: Python's or numpy's, but not a bool."""
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def check_field_types(options: Any, skip: Collection[str] = ()) -> None:
    """Raise InvalidParameterError for the first field of dataclass ``options`` (but those
    in ``skip``) whose value does not match its annotation."""
    values = {field.name: getattr(options, field.name) for field in dataclasses.fields(options)
              if field.name not in skip}  # fmt: skip
    check_arguments(type(options), values)


def check_arguments(function: Callable[..., Any], arguments: Mapping[str, Any]) -> None:
    """Raise InvalidParameterError for the first of ``arguments`` (name: value, as passed to
    ``function``, or a dataclass's fields) whose value does not match its annotation."""
    hints = _hints(function)
    for name, value in arguments.items():
        expected = hints.get(name)
        if expected is not None and not _matches(value, expected):
            described = _describe(expected)
            raise InvalidParameterError(f"{name} must be {described}, not {_shown(value)}")


def checked(function: _Function) -> _Function:
    """``function`` with its arguments checked against its annotations on each call
    (``check_arguments``); a numpy array counts as the list it holds (token arrays). Arguments
    that do not bind (an unknown keyword) are left to the call, which raises Python's own
    TypeError."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return function(*args, **kwargs)
        values = {name: value.tolist() if isinstance(value, np.ndarray) else value
                  for name, value in bound.arguments.items()}  # fmt: skip
        check_arguments(function, values)
        return function(*args, **kwargs)

    return cast(_Function, call)


@functools.cache
def _hints(annotated: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(annotated)
    except (NameError, TypeError):  # an annotation only a type checker resolves
        return {}


def _matches(value: Any, expected: Any) -> bool:
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if expected is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if expected is type(None):
        return value is None
    if expected is bool:
        return isinstance(value, bool | np.bool_) or (type(value) is int and value in (0, 1))
    if expected is int:
        return isinstance(value, int | np.integer) and not isinstance(value, bool)
    if expected is float:
        return is_number(value)
    if origin in (tuple, list, Sequence):
        if not isinstance(value, tuple | list):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            # A fixed tuple's length; its items' types are left to the function, whose own
            # message names the item ("strength must be a number, not '0.5'").
            return len(value) == len(args)
        item = _item_type(origin, args) or Any
        if item is int and all(type(v) is int for v in value):
            return True  # token lists: 100,000 items in milliseconds
        return all(_matches(v, item) for v in value)
    if origin in (dict, Mapping) or typing.is_typeddict(expected):
        return isinstance(value, Mapping)
    if isinstance(expected, type) and issubclass(expected, os.PathLike):  # a Path: text too
        return isinstance(value, str | os.PathLike)
    if isinstance(expected, type):
        return isinstance(value, expected)
    if isinstance(origin, type):  # another generic class (os.PathLike[str], Callable[...])
        return isinstance(value, origin)
    return True


def _describe(expected: Any) -> str:
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in args)
    if origin is typing.Literal:
        return " or ".join(repr(arg) for arg in args)
    if expected is type(None):
        return "None"
    if origin is tuple and args and args[-1] is not Ellipsis:
        return f"a tuple of {len(args)} ({', '.join(_describe(arg) for arg in args)})"
    if origin in (tuple, list, Sequence):
        item = _item_type(origin, args)
        return "a list" + (f" of items each {_describe(item)}" if item is not None else "")
    if origin in (dict, Mapping) or typing.is_typeddict(expected):
        return "a mapping"
    names = {bool: "a bool", int: "an integer", float: "a number", str: "a string"}
    return names.get(expected, getattr(expected, "__name__", str(expected)))


def _item_type(origin: Any, args: tuple[Any, ...]) -> Any:
    """The type of every item of ``Sequence[X]`` / ``tuple[X, ...]``; None for a fixed tuple."""
    return args[0] if args and (origin is not tuple or args[-1] is Ellipsis) else None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
