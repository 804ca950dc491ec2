"""Responses kept in memory for ``previous_response_id`` and ``GET /v1/responses/{id}``: at most
``size`` of them, each for ``ttl`` seconds after it was created, the oldest dropped first."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llamacrab.server._responses_schemas import InputItem


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    # The whole conversation up to and including this response's output, as input items. A
    # follow-up's history extends this tuple: items are shared between entries, not copied.
    history: tuple[InputItem, ...]
    expires: float


class ResponseStore:
    """Bounded by count and age. Used from the event loop only, so it needs no lock."""

    def __init__(self, size: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.size, self.ttl, self.clock = size, ttl, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict[str, Any], history: tuple[InputItem, ...]) -> None:
        if self.size == 0:
            return
        self._entries[response["id"]] = StoredResponse(response, history, self.clock() + self.ttl)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._drop_expired()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._drop_expired()
        return self._entries.pop(response_id, None) is not None

    def _drop_expired(self) -> None:
        # Every entry lives as long as the others, so the expired ones are the oldest.
        now = self.clock()
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self._entries.popitem(last=False)
