"""Stop strings: cut generated text at the first stop string, never emitting part of one."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed text as it is generated; get back what is safe to emit now."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = list(stops)  # none empty (stop_strings)
        self._pending = ""
        self.stopped = False
        self.remainder = ""  # the text from the stop string on, once stopped
        self.matched: str | None = None  # the stop string found (the first one in the text)

    def push(self, text: str) -> str:
        """Append ``text``; return the part that can no longer turn into a stop string."""
        self._pending += text
        hits = [(at, stop) for stop in self._stops if (at := self._pending.find(stop)) >= 0]
        if hits:
            self.stopped = True
            at, self.matched = min(hits, key=lambda hit: hit[0])  # a tie: the first given
            emitted, self.remainder = self._pending[:at], self._pending[at:]
            self._pending = ""
            return emitted
        hold = self._longest_partial_stop()
        cut = len(self._pending) - hold
        emitted, self._pending = self._pending[:cut], self._pending[cut:]
        return emitted

    def flush(self) -> str:
        """What was held back, once generation ends without a stop string."""
        emitted, self._pending = self._pending, ""
        return emitted

    def _longest_partial_stop(self) -> int:
        """Length of the longest suffix of the pending text that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest
