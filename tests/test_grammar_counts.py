"""GBNF repetitions past llama.cpp's count limit of 2000 hold exactly: its parser read a larger
maximum as none (``"a"{0,2500}`` took any number of a's) and refused a larger minimum."""

from __future__ import annotations

import pytest

from llamacrab import GrammarError, Llama, Model, SamplerChain, SamplingOptions
from llamacrab._native.gbnf.bounds import MAX_GRAMMAR_BYTES
from llamacrab._native.gbnf.counts import exact_repetitions


def _takes(model: Model, grammar: str, text: str) -> bool:
    """Whether ``grammar`` takes all of ``text`` and may end there (the tiny model's tokenizer
    puts a space before a text, which the root takes first)."""
    spaced = grammar.replace("root ::= ", 'root ::= " " ', 1)
    tokens = [*model.vocab.tokenize(text, add_special=False), model.vocab.eog_tokens[0]]
    with SamplerChain(model, SamplingOptions(grammar=spaced)) as chain:
        try:
            for token in tokens:
                chain.accept(token)
        except GrammarError:
            return False
    return True


@pytest.mark.parametrize(
    ("grammar", "text", "low", "high"),
    [
        ('root ::= "a"{0,2500}', "{}", 0, 2500),
        ('root ::= "b"{1,}  "a"{2100}', "b{}", 2100, 2100),
        ('root ::= [ab]{2001,4002} "c"', "{}c", 2001, 4002),
        ('root ::= ( "a" | "b" ){3,2003}', "{}", 3, 2003),
        # The names the rewrite would derive from x's are the grammar's own.
        ('root ::= x{0,3000}\nx ::= "a"\nx-1000 ::= "b"\nrepeat-1 ::= "b"', "{}", 0, 3000),
        ('root ::= ( "a"{0,2200} # a comment\n ){1}', "{}", 0, 2200),
    ],
    ids=["max", "min", "both", "group", "names-taken", "nested"],
)
def test_counts_past_the_limit_hold(
    tiny_llama: Llama, grammar: str, text: str, low: int, high: int
) -> None:
    model = tiny_llama.model
    inside = {n for n in (low, low + 1, high - 1, high) if low <= n <= high}
    for n in inside - {0}:  # an empty text has no space for the root to take
        assert _takes(model, grammar, text.format("a" * n)), n
    assert not _takes(model, grammar, text.format("a" * (high + 1)))
    if low:
        assert not _takes(model, grammar, text.format("a" * (low - 1)))


def test_a_grammar_without_such_counts_is_left_as_it_is() -> None:
    text = 'root ::= "1234"{2} [0-9]{1,2000} # 9999\n'
    assert exact_repetitions(text) is text


@pytest.mark.parametrize(
    "grammar",
    # A line ends a rule's items: llama.cpp refuses the count that starts the next. A count
    # without its brace was written out as if it had one (found by a red team).
    ['root ::= "a"\n{0,3000}', 'root ::= "a"{0,3000', 'root ::= "a"{0,3000 "b"'],
)
def test_what_is_not_gbnf_is_left_to_llama_cpp(tiny_llama: Llama, grammar: str) -> None:
    assert exact_repetitions(grammar) == grammar
    with pytest.raises(GrammarError):
        SamplerChain(tiny_llama.model, SamplingOptions(grammar=grammar))


def test_written_out_counts_stay_within_the_size_bound(tiny_llama: Llama) -> None:
    # Each distinct item repeated past the limit adds rules: many of them are refused by name.
    grammar = "root ::= " + " ".join(f'"{i}"{{0,3000}}' for i in range(12_000))
    assert len(grammar.encode()) <= MAX_GRAMMAR_BYTES
    with pytest.raises(GrammarError, match="counts past 2000 written out"):
        SamplerChain(tiny_llama.model, SamplingOptions(grammar=grammar))
