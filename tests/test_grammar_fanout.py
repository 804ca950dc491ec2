"""The structural bounds on grammars (``_native/gbnf/fanout.py``): what they count, the
left recursion they refuse, and that they leave ordinary grammars (llama.cpp's own examples
among them) and syntax errors alone."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from llamacrab import JSON_OBJECT_GRAMMAR, GrammarError, Llama, schema_to_grammar
from llamacrab._native.gbnf.bounds import check_grammar
from llamacrab._native.gbnf.fanout import check_grammar_fanout


@pytest.mark.parametrize(
    ("grammar", "count"),
    [
        ("root ::= ([a-z]?){24}", "1961256 ways"),  # C(24, 10): 10 letters among 24 slots
        ("root ::= " + " ".join(["[a-z]*"] * 12), "352716 ways"),
        ('root ::= x{300}\nx ::= "a" | "" | [0-9]', "600 ways to continue"),
        ('root ::= (a | b){200}\na ::= [a-z]?\nb ::= "q"', "400 ways to continue"),
        # A repetition of nothing: each copy a way on. The reliability suite's inputs section
        # (under ASan, seed 2026) found (("" ){0,100000}){0,100000}: all of 24 GiB, then
        # the OOM killer, inside llama.cpp's grammar sampler.
        ('root ::= ("" ){300} "a"', "301 ways to continue"),
        ('root ::= (("" ){0,100000}){0,100000}', "102500000 ways to continue"),
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


@pytest.mark.parametrize(
    ("grammar", "rule"),
    [
        ('root ::= r0 r1 root ""\nr0 ::= ("" | "")\nr1 ::= ""', "root"),  # seed 2031's abort
        ('root ::= x\nx ::= y x\ny ::= ("")', "x"),  # no stack from the start: an abort
        ('root ::= "a" r\nr ::= e r\ne ::= ("")', "r"),  # none after "a": an abort
        ('root ::= r0 root | "a"\nr0 ::= ("")', "root"),  # llama.cpp drops the recursion
        ('root ::= x "a"\nx ::= y x | "b"\ny ::= z\nz ::= ("" | "q")', "x"),
        ('root ::= root "a" | "b"', "root"),  # the direct kind llama.cpp refuses itself
    ],
)
def test_left_recursion_through_rules_that_match_nothing_is_refused(
    grammar: str, rule: str
) -> None:
    with pytest.raises(GrammarError, match=f"left-recursive: rule '{rule}'"):
        check_grammar_fanout(grammar)


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= (r0)* "a"\nr0 ::= ("" | "")',  # a repetition of nothing is not recursion
        'root ::= e "a" root | "b"\ne ::= ("")',  # a character before the recursion
        'root ::= "(" root ")" | ""',  # recursion in the middle
    ],
)
def test_recursion_after_a_character_passes(grammar: str) -> None:
    check_grammar_fanout(grammar)


def _alternation(rule: str, count: int) -> str:
    return f"{rule} ::= " + " | ".join(f'"w{i}"' for i in range(count))


@pytest.mark.parametrize(
    "grammar",
    [
        _alternation("root", 1025),  # a stack per literal: 20,000 took 77 s to be refused
        'root ::= "a"\n' + _alternation("start", 2000),  # grammar_root may pick another rule
    ],
)
def test_a_start_rule_of_more_ways_to_begin_than_the_stack_bound_is_refused(
    grammar: str,
) -> None:
    with pytest.raises(GrammarError, match="can begin more than 1024 ways"):
        check_grammar_fanout(grammar)


def test_an_enum_of_a_thousand_literals_at_the_start_passes() -> None:
    check_grammar_fanout(_alternation("root", 1000))


def test_an_alternation_of_twenty_thousand_literals_is_refused_before_llama_cpp_starts_it(
    tiny_llama: Llama,
) -> None:
    started = time.monotonic()
    with pytest.raises(GrammarError, match="rule 'root' can begin more than 1024 ways"):
        tiny_llama.create_completion("the cat", max_tokens=1, grammar=_alternation("root", 20000))
    assert time.monotonic() - started < 5


def _example_grammars() -> list[Path]:
    sys_dir = str(Path(__file__).resolve().parents[1] / "llamacrab-sys")
    if sys_dir not in sys.path:
        sys.path.insert(0, sys_dir)  # build_tools: the pinned source tree
    from build_tools.source import resolve_source

    return sorted((resolve_source().path / "grammars").glob("*.gbnf"))


def test_llama_cpp_example_grammars_pass_every_check() -> None:
    examples = _example_grammars()
    assert {"arithmetic.gbnf", "c.gbnf", "json.gbnf"} <= {path.name for path in examples}
    for path in examples:
        check_grammar(path.read_text(encoding="utf-8"))


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
