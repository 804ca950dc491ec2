"""Responses kept in memory for ``previous_response_id``, ``GET /v1/responses/{id}`` and its
``/input_items``: at most ``size`` of them holding at most ``max_bytes`` together, each for
``ttl`` seconds after it was created, the oldest dropped first."""

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
    # The whole conversation up to and including this response's output, as input items, each
    # with its id. A follow-up's history extends this tuple: items are shared between entries,
    # not copied.
    history: tuple[InputItem, ...]
    expires: float
    size: int  # bytes of JSON it added: the response and its request's input items

    @property
    def input_items(self) -> tuple[InputItem, ...]:
        """The items it was generated from: the history before its own output (which ends
        the history, one item for each of the response's output items)."""
        return self.history[: len(self.history) - len(self.response["output"])]


class ResponseStore:
    """Bounded by count, bytes and age (without a byte bound, 256 requests of 8 MiB kept 2 GiB
    for an hour). Used from the event loop only, so it needs no lock."""

    def __init__(self, size: int, ttl: float, max_bytes: int = 256 << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.size, self.ttl, self.max_bytes, self.clock = size, ttl, max_bytes, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        # Item id: each item with that id (by identity: histories share items) and how many
        # kept histories hold it, the newest last; item references need no walk through
        # every history, and an item goes with the last response holding it.
        self._items: dict[str, dict[int, tuple[InputItem, int]]] = {}

    def put(self, response: dict[str, Any], history: tuple[InputItem, ...], size: int) -> None:
        """Keep ``response`` (``size``: the bytes of JSON it adds); one larger than the whole
        bound is not kept."""
        if self.size == 0 or size > self.max_bytes:
            return
        entry = StoredResponse(response, history, self.clock() + self.ttl, size)
        self._drop(response["id"])
        self._entries[response["id"]] = entry
        self._bytes += size
        self._index(entry.history, +1)
        while len(self._entries) > self.size or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        self._drop_expired()
        return self._entries.get(response_id)

    def item(self, item_id: str) -> InputItem | None:
        """The item with this id in a kept conversation (the newest response's)."""
        self._drop_expired()
        held = self._items.get(item_id)
        return None if not held else next(reversed(held.values()))[0]

    def delete(self, response_id: str) -> bool:
        self._drop_expired()
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
            self._index(entry.history, -1)
        return entry is not None

    def _index(self, items: tuple[InputItem, ...], step: int) -> None:
        for item in items:
            item_id = getattr(item, "id", None)
            if item_id is None:
                continue
            held = self._items.setdefault(item_id, {})
            _, holders = held.pop(id(item), (item, 0)) if step > 0 else held[id(item)]
            if holders + step > 0:
                held[id(item)] = (item, holders + step)  # a new holder makes it the newest
            else:
                del held[id(item)]
            if not held:
                del self._items[item_id]

    def _drop_expired(self) -> None:
        # Every entry lives as long as the others, so the expired ones are the oldest.
        now = self.clock()
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self._drop(next(iter(self._entries)))
