"""Grammars whose check of one token takes billions of steps in llama.cpp, inside one sampling
call no timeout, cancel or close() interrupts, are refused by llamacrab-sys's
llama-grammar-work-budget patch with a GrammarError; ordinary grammars are left alone.

On Gemma 3's 262k vocabulary, before the patch: the ambiguous grammar took ~30 s for one token
(hours with 5 choices), the repeated 128-way alternation ~6 s a token (~30 s at 250 ways). Both
pass the static checks (gbnf.bounds, gbnf.fanout) and the 1,024-stack bound."""

from __future__ import annotations

import numpy as np
import pytest

from llamacrab import (
    Batch,
    Context,
    ContextParams,
    GrammarError,
    Llama,
    SamplerChain,
    SamplingOptions,
    schema_to_grammar,
)

from support import count_whole_chain_picks

_BUDGET = "needed more than 67108864 steps to check one token"


def _any_character_rules(width: int) -> str:
    # Not a newline: the model's first pick without the grammar, "\n\n", is refused, so the
    # chain applies the grammar to every candidate (a pick it allows is the only one checked).
    return "".join(f"a{i} ::= [^\\x00\\n]\n" for i in range(width))


def _choices(width: int) -> str:
    return " | ".join(f"a{i}" for i in range(width))


# Every split of a token among the nesting levels is a way to read it.
AMBIGUOUS = f"root ::= x root x | x\nx ::= {_choices(3)}\n{_any_character_rules(3)}"
# Each of 128 stacks expands the group again to 128 and compares each with those found.
REPEATED_WIDE = f"root ::= ( {_choices(128)} )*\n{_any_character_rules(128)}"


@pytest.mark.parametrize("grammar", [AMBIGUOUS, REPEATED_WIDE], ids=["ambiguous", "wide"])
def test_a_grammar_past_the_work_budget_is_refused_and_the_llama_goes_on(
    gemma: Llama, grammar: str
) -> None:
    with pytest.raises(GrammarError, match=_BUDGET) as refused:
        gemma.create_completion("Write a story.", grammar=grammar, max_tokens=2, temperature=0)
    assert "follows every way the grammar can read a candidate token" in str(refused.value)
    assert "parse stack" not in str(refused.value)  # the stack bound's explanation
    text = gemma.create_completion("Write a story.", max_tokens=2, temperature=0).choices[0].text
    assert text
    yes_no = 'root ::= "yes" | "no"'
    answer = gemma.create_completion("Yes or no?", grammar=yes_no, max_tokens=2, temperature=0)
    assert answer.choices[0].text in ("yes", "no")


def test_the_chain_refuses_until_reset_after_the_budget(gemma: Llama) -> None:
    model = gemma.model
    context = Context(model, ContextParams(n_ctx=64, n_threads=2, graph_sampling="off"))
    with Batch(8) as batch:
        batch.set(np.array(model.vocab.tokenize("Write a story."), np.int32), 0)
        context.decode(batch)
    chain = SamplerChain(model, SamplingOptions(grammar=AMBIGUOUS, temperature=0))
    try:
        with pytest.raises(GrammarError, match=_BUDGET):
            chain.sample(context)
        with pytest.raises(GrammarError, match=r"reset\(\)"):
            chain.sample(context)
        chain.reset()  # a fresh grammar: it runs, and into the budget again
        with pytest.raises(GrammarError, match=_BUDGET):
            chain.sample(context)
    finally:
        chain.close()
        context.close()


ORDINARY = {
    "json-schema": schema_to_grammar(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "age": {"type": "integer"},
                "kind": {"enum": [f"kind-{i}" for i in range(64)]},
            },
            "required": ["name", "tags"],
        }
    ),
    # As many stacks as the 1,024-stack bound leaves, each looking at every token.
    "enum-1000": "root ::= " + " | ".join(f'"\\"word{i}\\""' for i in range(1000)),
    "any-text": "root ::= ([a-z] | [A-Z] | [0-9] | [ \\t] | [.,;:!?'-])*",
}


@pytest.mark.parametrize("name", ORDINARY)
def test_ordinary_grammars_stay_within_the_budget(
    gemma: Llama, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole_chain_picks = count_whole_chain_picks(monkeypatch)
    result = gemma.create_completion(
        "Write a story.", grammar=ORDINARY[name], max_tokens=8, temperature=0
    )
    assert result.choices[0].tokens
    assert whole_chain_picks[0] > 0  # the grammar was applied to every candidate
