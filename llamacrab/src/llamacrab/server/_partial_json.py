"""The complete part of a JSON text cut short (a tool call's arguments at max_tokens), as an
Anthropic client reads a stream's (its SDK's partial mode): containers are closed where the text
stops, and a key, string, number or literal not finished by then is left out."""

from __future__ import annotations

import json
import re
from typing import Any

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_LITERALS = {"true": True, "false": False, "null": None}
_WHITESPACE = " \t\n\r"
MAX_DEPTH = 64  # a model's arguments nest far less; what is deeper is left out


class _Cut(Exception):
    """The text stops (or turns into something other than JSON) inside a scalar or a key."""


def partial_object(text: str) -> dict[str, Any] | None:
    """The object ``text`` begins, with its members complete where the text stops (or turns
    into something other than JSON); None when it begins no object."""
    reader = _Reader(text)
    try:
        if reader.peek() != "{":
            return None
        value, _ = reader.value(0)
    except _Cut:
        return None
    return value if isinstance(value, dict) else None


class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0

    def peek(self) -> str:
        """The next character that is not whitespace; _Cut at the end."""
        while self.i < len(self.text) and self.text[self.i] in _WHITESPACE:
            self.i += 1
        if self.i >= len(self.text):
            raise _Cut
        return self.text[self.i]

    def value(self, depth: int) -> tuple[Any, bool]:
        """The value here and whether it ended; a scalar that did not is a _Cut."""
        char = self.peek()
        if char in "{[":
            if depth >= MAX_DEPTH:
                raise _Cut
            return self.container(depth + 1, char == "{")
        if char == '"':
            return self.string(), True
        for word, literal in _LITERALS.items():
            if self.text.startswith(word, self.i):
                self.i += len(word)
                return literal, True
        number = _NUMBER.match(self.text, self.i)
        if number is None or number.end() == len(self.text):  # more digits may have followed
            raise _Cut
        self.i = number.end()
        return json.loads(number.group()), True

    def string(self) -> str:
        end = self.i
        while True:
            end = self.text.find('"', end + 1)
            if end < 0:
                raise _Cut
            before = end
            while self.text[before - 1] == "\\":
                before -= 1
            if (end - before) % 2 == 0:  # not an escaped quote
                break
        try:
            loaded = json.loads(self.text[self.i : end + 1])
        except json.JSONDecodeError:
            raise _Cut from None
        self.i = end + 1
        return str(loaded)

    def container(self, depth: int, is_object: bool) -> tuple[dict[str, Any] | list[Any], bool]:
        """An object or array from its bracket, and whether it closed: where the text stops,
        with the members complete by then (a container cut inside kept as far as it goes)."""
        self.i += 1
        members: dict[str, Any] | list[Any] = {} if is_object else []
        closing = "}" if is_object else "]"
        try:
            if self.peek() == closing:
                self.i += 1
                return members, True
            while True:
                key = self._key() if isinstance(members, dict) else None
                value, ended = self.value(depth)
                if isinstance(members, dict):
                    members[str(key)] = value
                else:
                    members.append(value)
                if not ended:  # the text stopped inside it
                    return members, False
                separator = self.peek()
                self.i += 1
                if separator == closing:
                    return members, True
                if separator != ",":
                    return members, False
        except _Cut:
            return members, False

    def _key(self) -> str:
        if self.peek() != '"':
            raise _Cut
        key = self.string()
        if self.peek() != ":":
            raise _Cut
        self.i += 1
        return key
