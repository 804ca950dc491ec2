"""The structural bounds on grammars (``_native/grammar_fanout.py``): what they count, and
that they leave ordinary grammars and syntax errors alone."""

from __future__ import annotations

import time

import pytest

from llamacrab import JSON_OBJECT_GRAMMAR, GrammarError, Llama, schema_to_grammar
from llamacrab._native.grammar_fanout import check_grammar_fanout


@pytest.mark.parametrize(
    ("grammar", "count"),
    [
        ("root ::= ([a-z]?){24}", "1961256 ways"),  # C(24, 10): 10 letters among 24 slots
        ("root ::= " + " ".join(["[a-z]*"] * 12), "352716 ways"),
        ('root ::= x{300}\nx ::= "a" | "" | [0-9]', "600 ways to continue"),
        ('root ::= (a | b){200}\na ::= [a-z]?\nb ::= "q"', "400 ways to continue"),
    ],
)
def test_the_counts_refused(grammar: str, count: str) -> None:
    with pytest.raises(GrammarError, match=count):
        check_grammar_fanout(grammar)


@pytest.mark.parametrize(
    "grammar",
    [
        "root ::= ([a-z]?){16}",  # 12,870 splits: 0.8 s for two tokens of Gemma 3
        "root ::= [a-z]{0,1000}",  # one item: a repetition of a required class
        'root ::= ("ab"?){24}',  # two characters each: 42,504 splits of 10
        'root ::= ("a" [0-9]?){100}',  # the optional digits never share a run
        "root ::= ([a-z]* \" \"?)*",  # unbounded, but one copy reachable at a time
        JSON_OBJECT_GRAMMAR,
        schema_to_grammar({"type": "object", "properties": {f"p{i}": {"type": "string"}
                                                            for i in range(40)}}),
    ],
)  # fmt: skip
def test_ordinary_grammars_pass(grammar: str) -> None:
    check_grammar_fanout(grammar)


def test_a_chain_of_thousands_of_rules_is_walked_without_recursion() -> None:
    chain = "".join(f'r{i} ::= "x" r{i + 1}?\n' for i in range(4000))
    started = time.monotonic()
    check_grammar_fanout(f'root ::= r0\n{chain}r4000 ::= "y"\n')
    assert time.monotonic() - started < 5


def test_syntax_errors_are_left_to_llama_cpp(tiny_llama: Llama) -> None:
    for broken in ["root ::= (", "root ::= undefined-rule", "root ::= [a-", "no rule here"]:
        check_grammar_fanout(broken)  # not this parser's to judge
        with pytest.raises(GrammarError, match="invalid grammar"):
            tiny_llama.create_completion("the cat", max_tokens=1, grammar=broken)
