"""Stop strings never leak, even partially, whatever the chunking of the text."""

from __future__ import annotations

import pytest

from llamacrab._engine.stop import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        out.append(matcher.push(piece))
        if matcher.stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


@pytest.mark.parametrize("split", range(1, 8))
def test_stop_split_across_pieces_is_cut(split: int) -> None:
    text = "Hello world. END and more"
    pieces = [text[i : i + split] for i in range(0, len(text), split)]
    out, stopped = run(["END"], pieces)
    assert stopped and "".join(out) == "Hello world. "
    assert not any("E" in piece for piece in out)  # not even "E" of "END" was emitted early


def test_text_resembling_a_stop_is_released_when_it_diverges() -> None:
    out, stopped = run(["###"], ["a#", "#b", "c"])
    assert not stopped and "".join(out) == "a##bc"
    assert out[0] == "a"  # "#" held back while it could still start "###"


def test_earliest_of_several_stops_wins() -> None:
    out, stopped = run(["world", "lo w"], ["hello world"])
    assert stopped and out == ["hel"]


def test_no_stops_passes_everything_through() -> None:
    out, stopped = run([], ["a", "b"])
    assert out == ["a", "b", ""] and not stopped
