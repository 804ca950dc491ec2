"""llama.cpp and ggml log lines go to the Python logger ``llamacrab`` (quiet unless configured)."""

from __future__ import annotations

import logging
import threading

from llamacrab_sys import lib, set_log_handler

logger = logging.getLogger("llamacrab")
logger.addHandler(logging.NullHandler())

_LEVELS = {
    lib.GGML_LOG_LEVEL_DEBUG: logging.DEBUG,
    lib.GGML_LOG_LEVEL_INFO: logging.INFO,
    lib.GGML_LOG_LEVEL_WARN: logging.WARNING,
    lib.GGML_LOG_LEVEL_ERROR: logging.ERROR,
}


class _LineAssembler:
    """llama.cpp logs in fragments (GGML_LOG_LEVEL_CONT continues a line): emit whole lines."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = ""
        self._level = logging.INFO
        self.last_error = ""

    def __call__(self, ggml_level: int, text: str) -> None:
        with self._lock:
            if ggml_level != lib.GGML_LOG_LEVEL_CONT:
                self._level = _LEVELS.get(ggml_level, logging.INFO)
            if self._level >= logging.ERROR:
                self.last_error = text.strip() or self.last_error
            if not logger.isEnabledFor(self._level):
                return
            self._pending += text
            if not self._pending.endswith("\n"):
                return
            lines, self._pending = self._pending, ""
        for line in lines.rstrip("\n").splitlines():
            logger.log(self._level, "%s", line)

    def take_last_error(self) -> str:
        """The last error line llama.cpp logged (cleared), to explain a NULL it returned."""
        with self._lock:
            message, self.last_error = self.last_error, ""
        return message


log_lines = _LineAssembler()


def install() -> None:
    set_log_handler(log_lines)
