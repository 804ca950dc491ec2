"""The error for a llama-cpp-python keyword whose value llamacrab cannot honour."""

from __future__ import annotations

from collections.abc import Iterable

from llamacrab import InvalidParameterError


class UnsupportedParameterError(InvalidParameterError, NotImplementedError):
    """A llama-cpp-python keyword (or value of one) that llamacrab cannot honour. Raised instead
    of ignoring it, so nothing changes behaviour silently. Also a ValueError and a
    NotImplementedError."""

    def __init__(self, reasons: Iterable[str]) -> None:
        self.reasons = tuple(reasons)
        super().__init__("llamacrab.compat cannot honour " + "; ".join(self.reasons))


def unknown_keywords(where: str, names: Iterable[str]) -> TypeError:
    listed = ", ".join(repr(n) for n in sorted(names))
    return TypeError(
        f"{where} got unexpected keyword arguments: {listed} (llama-cpp-python ignores unknown "
        "keywords silently; llamacrab.compat refuses them)"
    )
