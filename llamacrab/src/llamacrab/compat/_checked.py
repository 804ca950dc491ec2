"""Code written for llama-cpp-python passes its keywords through unchecked, and a value of
another type there failed deep inside (a TypeError from a comparison, an AttributeError). The
public methods check their arguments against their annotations first: such a value is an
InvalidParameterError naming the keyword (a ValueError, as llama-cpp-python's own refusals)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np

from llamacrab._field_types import check_arguments

_Method = TypeVar("_Method", bound=Callable[..., Any])


def checked(method: _Method) -> _Method:
    """``method`` with its arguments checked against its annotations on each call; a numpy
    array counts as the list it holds (token arrays). Arguments that do not bind (an unknown
    keyword) are left to the call, which raises Python's own TypeError."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return method(*args, **kwargs)
        values = {name: value.tolist() if isinstance(value, np.ndarray) else value
                  for name, value in bound.arguments.items()}  # fmt: skip
        check_arguments(method, values)
        return method(*args, **kwargs)

    return cast(_Method, call)
