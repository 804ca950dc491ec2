"""llama.cpp and ggml log lines go to the Python logger ``llamacrab`` (quiet unless configured)."""

from __future__ import annotations

import logging
import threading
from collections import deque

from llamacrab._native.fork import reset_in_child
from llamacrab_sys import lib, set_log_handler

logger = logging.getLogger("llamacrab")
logger.addHandler(logging.NullHandler())

_LEVELS = {
    lib.GGML_LOG_LEVEL_DEBUG: logging.DEBUG,
    lib.GGML_LOG_LEVEL_INFO: logging.INFO,
    lib.GGML_LOG_LEVEL_WARN: logging.WARNING,
    lib.GGML_LOG_LEVEL_ERROR: logging.ERROR,
}


_ERRORS_KEPT = 3


class _LineAssembler:
    """llama.cpp logs in fragments (GGML_LOG_LEVEL_CONT continues a line): emit whole lines."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = ""
        self._level = logging.INFO
        # The error lines since the last take_errors(): a failing loader often logs its
        # reason first and a generic "failed to load" after it.
        self.errors: deque[str] = deque(maxlen=_ERRORS_KEPT)

    def __call__(self, ggml_level: int, text: str) -> None:
        with self._lock:
            if ggml_level != lib.GGML_LOG_LEVEL_CONT:
                self._level = _LEVELS.get(ggml_level, logging.INFO)
            if self._level >= logging.ERROR:  # line by line: a rule of ===== explains nothing
                self.errors.extend(
                    line.strip() for line in text.splitlines() if line.strip("=-*# \t")
                )
            if not logger.isEnabledFor(self._level):
                return
            self._pending += text
            if not self._pending.endswith("\n"):
                return
            lines, self._pending = self._pending, ""
        for line in lines.rstrip("\n").splitlines():
            logger.log(self._level, "%s", line)

    def take_errors(self) -> str:
        """The error lines llama.cpp logged since the last call (the last few, joined; then
        cleared), to explain a NULL it returned."""
        with self._lock:
            lines = list(dict.fromkeys(self.errors))
            self.errors.clear()
        return " / ".join(lines)


log_lines = _LineAssembler()
reset_in_child(log_lines._lock)


def install() -> None:
    set_log_handler(log_lines)
