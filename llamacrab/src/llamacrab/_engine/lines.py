"""Line rules for code completion, read from the generated text as llama-server reads them
(its ``n_indent`` and ``t_max_predict_ms``): every line after the first indented by at least
``min_indent`` spaces or tabs, and a time limit that ends the generation at a newline."""

from __future__ import annotations

import time

from llamacrab._exceptions import InvalidParameterError

_INDENT = " \t"


def check_line_rules(min_indent: int, stop_at_newline_after: float | None) -> None:
    """Raise InvalidParameterError for a negative ``min_indent`` or a time limit that is not a
    positive number of seconds (NaN included: it would never pass)."""
    if min_indent < 0:
        raise InvalidParameterError(f"min_indent must be >= 0 characters, not {min_indent}")
    if stop_at_newline_after is not None and not stop_at_newline_after > 0:
        raise InvalidParameterError(
            f"stop_at_newline_after must be > 0 seconds or None, not {stop_at_newline_after}"
        )


class LineRules:
    """Fed each sampled token's text (after stop strings), says what of it to emit and whether
    the generation ends there."""

    def __init__(self, min_indent: int, stop_at_newline_after: float | None) -> None:
        self.min_indent = min_indent
        self.time_limit = stop_at_newline_after
        # The spaces and tabs that open the current line, while nothing else has come; None on
        # the first line (it continues the prompt's) and once a line has been judged.
        self._indent: int | None = None
        self._cut = False  # a line was cut short: nothing after it is output
        self._first_token_at: float | None = None

    def token(self, text: str) -> tuple[str, bool]:
        """A token's text as it may be output, and whether the generation ends with it: at a
        line indented less than ``min_indent`` (cut after its spaces and tabs), or at a
        newline once ``stop_at_newline_after`` seconds have passed since the first token."""
        text = self.cut(text)
        if self._cut:
            return text, True
        if self.time_limit is None:
            return text, False
        now = time.monotonic()
        if self._first_token_at is None:
            self._first_token_at = now
        return text, "\n" in text and now - self._first_token_at > self.time_limit

    def cut(self, text: str) -> str:
        """``text`` up to the first character (a newline too) of a line after a newline that
        opens with fewer than ``min_indent`` spaces and tabs; nothing once one was cut."""
        if self._cut:
            return ""
        if not self.min_indent or (self._indent is None and "\n" not in text):
            return text
        for at, char in enumerate(text):
            if self._indent is not None:
                if char in _INDENT:
                    self._indent += 1
                    continue
                if self._indent < self.min_indent:
                    self._cut = True
                    return text[:at]
                self._indent = None
            if char == "\n":
                self._indent = 0
        return text
