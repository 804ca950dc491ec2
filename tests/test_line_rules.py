"""Line rules for code completion (llama-server's n_indent and t_max_predict_ms): the
completion keywords ``min_indent`` and ``stop_at_newline_after``, on one slot and on parallel
slots, and the text rule itself (``LineRules``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llamacrab import InvalidParameterError, Llama
from llamacrab._engine.lines import LineRules

GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 200}
# Lines indented 0 (the first: exempt), 4 and 2 spaces, then 0.
INDENTED = r'root ::= "a\n    b\n  c\nd"'
LINES = r'root ::= ("x\n"){40}'  # 80 tokens: far more than a microsecond of generating


@pytest.fixture(scope="module", params=[None, 2], ids=["one-slot", "parallel"])
def llm(request: pytest.FixtureRequest, tiny_model_path: Path) -> Iterator[Llama]:
    with Llama(tiny_model_path, n_ctx=1024, n_threads=2, parallel=request.param) as model:
        yield model


def text_and_end(llm: Llama, **kwargs: Any) -> tuple[str, str | None]:
    choice = llm.create_completion("the cat", **GREEDY, **kwargs).choices[0]
    return choice.text, choice.finish_reason


def test_min_indent_cuts_the_first_line_indented_less(llm: Llama) -> None:
    assert text_and_end(llm, grammar=INDENTED) == ("a\n    b\n  c\nd", "eos")
    # The line "  c" ends it, cut after its spaces; the first line is never judged.
    assert text_and_end(llm, grammar=INDENTED, min_indent=4) == ("a\n    b\n  ", "length")
    assert text_and_end(llm, grammar=INDENTED, min_indent=3) == ("a\n    b\n  ", "length")
    assert text_and_end(llm, grammar=INDENTED, min_indent=2) == ("a\n    b\n  c\n", "length")
    assert text_and_end(llm, grammar=INDENTED, min_indent=1) == ("a\n    b\n  c\n", "length")


def test_a_stream_never_shows_the_cut_text(llm: Llama) -> None:
    chunks = list(llm.stream_completion("the cat", grammar=INDENTED, min_indent=4, **GREEDY))
    assert "".join(c.text for c in chunks) == "a\n    b\n  "
    assert chunks[-1].finish_reason == "length"


def test_stop_at_newline_after_ends_at_a_newline_past_the_time(llm: Llama) -> None:
    assert text_and_end(llm, grammar=LINES) == ("x\n" * 40, "eos")
    # The first token starts the clock: the next token, a newline, comes after it.
    assert text_and_end(llm, grammar=LINES, stop_at_newline_after=1e-9) == ("x\n", "length")
    # Never reached: the grammar's end comes first.
    assert text_and_end(llm, grammar=LINES, stop_at_newline_after=3600) == ("x\n" * 40, "eos")


def test_a_stop_string_held_back_is_output_at_a_timed_newline(llm: Llama) -> None:
    # "\nx" is held back as a possible start of the stop string until the token after it.
    result = llm.create_completion("the cat", grammar=r'root ::= "x\nx\ny"', stop="\nxz",
                                   stop_at_newline_after=1e-9, **GREEDY)  # fmt: skip
    choice = result.choices[0]
    assert (choice.text, choice.finish_reason) == ("x\nx\n", "length")


@pytest.mark.parametrize(
    ("keyword", "value", "message"),
    [
        ("min_indent", -1, "min_indent must be >= 0"),
        ("min_indent", 1.5, "min_indent must be an integer"),
        ("stop_at_newline_after", 0, "stop_at_newline_after must be > 0"),
        ("stop_at_newline_after", -1.0, "stop_at_newline_after must be > 0"),
        ("stop_at_newline_after", float("nan"), "stop_at_newline_after must be > 0"),
        ("stop_at_newline_after", "1", "stop_at_newline_after must be a number"),
    ],
)
def test_bad_values_are_refused(llm: Llama, keyword: str, value: object, message: str) -> None:
    with pytest.raises(InvalidParameterError, match=message):
        llm.create_completion("the cat", max_tokens=2, **{keyword: value})


# -- the rule on text, token by token ------------------------------------------------------------


def fed(rules: LineRules, pieces: list[str]) -> tuple[str, int | None]:
    """The text output and the index of the piece that ended the generation, if any."""
    out = ""
    for i, piece in enumerate(pieces):
        text, ended = rules.token(piece)
        out += text
        if ended:
            return out, i
    return out, None


def test_indentation_is_counted_across_tokens_in_spaces_and_tabs() -> None:
    assert fed(LineRules(2, None), ["def f():", "\n", " ", "\t", "x", "\n", " y"]) == (
        "def f():\n \tx\n ", 6,
    )  # fmt: skip
    assert fed(LineRules(2, None), ["a\n  b\n", "  c"]) == ("a\n  b\n  c", None)


def test_a_blank_line_counts_and_the_first_line_does_not() -> None:
    assert fed(LineRules(2, None), ["x", "\n\n", "  y"]) == ("x\n", 1)
    assert fed(LineRules(2, None), ["x\n  \n", "  y"]) == ("x\n  \n  y", None)
    assert fed(LineRules(4, None), ["no indent here"]) == ("no indent here", None)


def test_nothing_is_output_after_a_cut() -> None:
    rules = LineRules(1, None)
    assert rules.token("a\nb") == ("a\n", True)
    assert rules.cut("more") == ""


def test_rules_that_are_off_change_nothing() -> None:
    pieces = ["a\n", "b\n", "\n"]
    assert fed(LineRules(0, None), pieces) == ("a\nb\n\n", None)
