"""A JSON object cut short keeps what of it is complete (a tool call's input at max_tokens), as
Anthropic's SDK reads a stream's; whatever the text, the answer is an object or None."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from llamacrab.server._partial_json import MAX_DEPTH, partial_object


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{", {}),
        ('{"city": "Lis', {}),
        ('{"city": "Lisbon", "days": 3', {"city": "Lisbon"}),  # 3 may have gone on: 30
        ('{"city": "Lisbon", "days": 3,', {"city": "Lisbon", "days": 3}),
        ('{"city": "Lisbon", "days": 3}', {"city": "Lisbon", "days": 3}),
        ('{"a": [1, 2, {"b": tr', {"a": [1, 2, {}]}),  # containers kept as far as they go
        ('{"a": {"b": {"c": "d"', {"a": {"b": {"c": "d"}}}),
        ('{"a": "x\\"y", "b', {"a": 'x"y'}),  # an escaped quote ends no string
        ('{"a": "\\\\", "b": nul', {"a": "\\"}),
        ('{"a": "\\u00e9", "b": "\\u00', {"a": "é"}),
        ('{"a" 1}', {}),  # no longer JSON: what came before it
        ('{"a": 1}garbage', {"a": 1}),
        ('  {"a": [] , "b": {}}', {"a": [], "b": {}}),
        ("", None),
        ("[1, 2]", None),
        ('"text"', None),
        ("nothing", None),
    ],
)
def test_what_is_complete_is_kept(text: str, expected: dict[str, Any] | None) -> None:
    assert partial_object(text) == expected


def test_every_cut_of_an_object_is_a_prefix_of_it() -> None:
    whole = {"city": "Lisbon", "days": [1, 22, 333], "units": {"t": "C", "wind": None},
             "exact": True, "note": 'say "hi"\\n', "n": -1.5e3}  # fmt: skip
    text = json.dumps(whole)
    seen = []
    for end in range(len(text) + 1):
        cut = partial_object(text[:end])
        if end == 0:
            assert cut is None
            continue
        assert isinstance(cut, dict) and _within(cut, whole), text[:end]
        seen.append(cut)
    assert seen[-1] == whole
    assert len({json.dumps(c) for c in seen}) > 8  # it grows as the text does


def _within(part: Any, whole: Any) -> bool:
    """Whether ``part`` is ``whole`` with members left out (containers, recursively)."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(
            k in whole and _within(v, whole[k]) for k, v in part.items()
        )
    if isinstance(part, list):
        return (
            isinstance(whole, list)
            and len(part) <= len(whole)
            and all(_within(p, w) for p, w in zip(part, whole, strict=False))
        )
    return bool(part == whole)


def test_any_text_gives_an_object_or_none_quickly() -> None:
    rng = random.Random(7)
    alphabet = '{}[]",:\\ 0123456789.-eEtrufalsn\u00e9ab'
    for _ in range(3000):
        text = "{" + "".join(rng.choice(alphabet) for _ in range(rng.randrange(40)))
        assert isinstance(partial_object(text), dict)
    deep = "{" + '"a": [' * 10_000  # far past any model's nesting: no RecursionError
    depth, value = 0, partial_object(deep)
    while isinstance(value, dict | list) and value:
        value = value["a"] if isinstance(value, dict) else value[0]
        depth += 1
    assert depth <= MAX_DEPTH
