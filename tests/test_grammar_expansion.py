"""The bound on the elements llama.cpp's grammar parser builds when it expands repetitions
(``_native/gbnf/expansion.py``): a long literal or class repeated 2000 times took seconds and
gigabytes to parse (a 64 KB grammar: 8.9 s, 2.6 GB), from GBNF or from a response_format."""

from __future__ import annotations

import pytest

from llamacrab import GrammarError, Llama, schema_to_grammar
from llamacrab._native.gbnf.bounds import check_grammar
from llamacrab._native.gbnf.expansion import (
    MAX_GRAMMAR_ELEMENTS,
    class_elements,
    literal_elements,
)

LIMIT = f"the limit is {MAX_GRAMMAR_ELEMENTS}"
# Characters that, repeated 2000 times, take the count just past the limit.
JUST_OVER = MAX_GRAMMAR_ELEMENTS // 2000 + 1


@pytest.mark.parametrize(
    ("grammar", "repetition"),
    [
        ('root ::= "' + "a" * 64_000 + '"{2000}', "{2000}"),  # the audit's: 8.9 s, 2.6 GB
        ('root ::= "' + "a" * 64_000 + '"{0,2000}', "{0,2000}"),
        ("root ::= [" + "a" * 64_000 + "]{0,2000}", "{0,2000}"),
        ('root ::= x\nx ::= "' + "a" * JUST_OVER + '"{2000}', "{2000} on line 2"),
        # Nested repetitions multiply (llama.cpp allows 2 x 1000 copies)...
        ('root ::= "' + "a" * JUST_OVER + '"{2}{1000}', "{1000}"),
        # ...and so do the rules each optional copy adds (item, reference, ALT and END).
        ("root ::= " + ' "a"{0,2000}' * 250, "{0,2000}"),
    ],
    ids=["literal", "optional-literal", "class", "second-line", "nested", "many-optional"],
)
def test_a_repetition_past_the_bound_is_refused_by_name(grammar: str, repetition: str) -> None:
    with pytest.raises(GrammarError, match=LIMIT) as refused:
        check_grammar(grammar)
    assert f"the repetition {repetition}" in str(refused.value)


def test_elements_are_counted_as_llama_cpp_builds_them() -> None:
    assert literal_elements(r"a\x41\u00e9\U0001F600\n\"") == 6  # an escape is one character
    assert class_elements("a-z0-9_") == 5  # a range is two elements, its "-" none
    assert class_elements("^-a-") == 3  # a leading ^ none; "-" first or last is a character
    assert class_elements(r"\--\]") == 2  # an escaped "-" can start a range
    over = "a" * JUST_OVER
    with pytest.raises(GrammarError, match=LIMIT):
        check_grammar(f"root ::= [{over}]{{2000}}")
    # A class of ranges: each range counts two.
    with pytest.raises(GrammarError, match=LIMIT):
        check_grammar("root ::= [" + "a-b" * (JUST_OVER // 2 + 1) + "]{2000}")
    check_grammar(f"root ::= [{over[:-2]}]{{2000}}")


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "' + "a" * (JUST_OVER - 2) + '"{2000}',  # just under the bound
        'root ::= ("' + "a" * 60_000 + '"){2000}',  # a group repeated copies one reference
        'root ::= ("' + "a" * JUST_OVER + '"{2}){1000}',
        'root ::= x{2000}\nx ::= "' + "a" * 60_000 + '"',  # so does a rule
        schema_to_grammar({"type": "object", "required": [f"p{i}" for i in range(200)],
                           "properties": {f"p{i}": {"type": "string", "maxLength": 2000}
                                          for i in range(200)}}),
        schema_to_grammar({"type": "array", "maxItems": 2000,
                           "items": {"type": "string", "pattern": "[a-zA-Z0-9_-]{1,2000}"}}),
    ],
    ids=["just-under", "group", "group-of-nested", "rule", "200-long-strings", "patterns"],
)  # fmt: skip
def test_large_repetitions_within_the_bound_pass(grammar: str) -> None:
    check_grammar(grammar)


def test_the_library_refuses_before_llama_cpp_parses(tiny_llama: Llama) -> None:
    over = "a" * JUST_OVER
    with pytest.raises(GrammarError, match=LIMIT):
        tiny_llama.create_completion("the cat", max_tokens=1, grammar=f'root ::= "{over}"{{2000}}')
    # A JSON Schema pattern: every chat route's response_format takes this path.
    schema = {"type": "string", "pattern": f"[{over}]{{2000}}"}
    for response_format in (
        {"type": "json_object", "schema": schema},
        {"type": "json_schema", "json_schema": {"schema": schema}},
    ):
        with pytest.raises(GrammarError, match=LIMIT):
            tiny_llama.create_chat_completion(
                [{"role": "user", "content": "Hi!"}], chat_format="chatml",
                response_format=response_format, max_tokens=1,
            )  # fmt: skip
    # Just under the bound, the grammar parses and runs.
    fine = tiny_llama.create_completion(
        "the cat", max_tokens=2, grammar=f'root ::= "{over[:-2]}"{{2000}}'
    )
    assert set(fine.text) <= {"a"}
