"""A chain with a grammar picks as llama-server does: first without the grammar, the pick then
checked by the grammar alone, and drawn again with the grammar only when it is refused. Greedy
tokens are those of the grammar applied to every candidate; sampled ones follow llama-server's
distribution."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llamacrab import CustomSampler, Llama, SamplerChain, SamplingOptions, schema_to_grammar
from llamacrab._native.grammar_sampler import refused

from support import chain_distribution, chi2_sf, chi_square, count_whole_chain_picks

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "hobbies"],
}


class _Unchanged(CustomSampler):
    """A Python sampler that changes nothing: its chain applies the grammar to every candidate."""

    def apply(self, candidates: np.ndarray) -> None:
        pass


@pytest.mark.parametrize("min_tokens", [0, 25])  # 25: the end tokens banned by a Python sampler
def test_greedy_with_a_grammar_picks_what_the_whole_chain_picks(
    gemma: Llama, monkeypatch: pytest.MonkeyPatch, min_tokens: int
) -> None:
    full_picks = count_whole_chain_picks(monkeypatch)
    prompt = "Describe a crab as JSON with its name, age and hobbies:\n"
    options = {"grammar": schema_to_grammar(SCHEMA), "max_tokens": 40, "temperature": 0,
               "min_tokens": min_tokens}  # fmt: skip
    checked = gemma.create_completion(prompt, **options).choices[0]
    refused_picks = full_picks[0]
    whole = gemma.create_completion(prompt, custom_samplers=[_Unchanged()], **options).choices[0]
    assert checked.tokens == whole.tokens
    assert full_picks[0] - refused_picks >= len(whole.tokens)  # every pick, with a Python sampler
    # Both ways were taken: picks the grammar allowed at once, and ones it refused.
    assert 0 < refused_picks < len(checked.tokens) / 2


def test_a_grammar_samples_as_llama_server_does(tiny_model_path: Path) -> None:
    """Token frequencies over 3,000 seeded draws against llama-server's distribution: a token
    the grammar allows has its probability under the chain without the grammar, plus the
    probability that pick was refused times its probability under the chain with the grammar.
    Fixed seeds: the outcome is the same every run."""
    n, grammar = 3000, "root ::= [A-Z_;(]+"
    truncation = {"top_k": 12, "top_p": 0.9, "min_p": 0.02, "temperature": 0.8}
    with Llama(tiny_model_path, n_ctx=64, n_threads=2, graph_sampling="off") as llm:
        llm.create_completion("the cat sat on", max_tokens=0)
        context, model = llm.context, llm.model
        logits = context.logits().astype(np.float64)
        draws: dict[int, int] = {}
        for seed in range(n):
            options = SamplingOptions(grammar=grammar, seed=seed, **truncation)
            with SamplerChain(model, options) as chain:
                token = chain.sample(context)
            draws[token] = draws.get(token, 0) + 1
        chain = SamplerChain(model, SamplingOptions(grammar=grammar))
        with chain, chain.exclusive() as pointer:
            ids = np.arange(model.vocab.n_tokens, dtype=np.int32)
            refusals = refused(chain._grammar(pointer), ids)
    values = truncation.values()
    free = chain_distribution(logits, *values)  # type: ignore[arg-type]
    constrained = chain_distribution(np.where(refusals, -np.inf, logits), *values)  # type: ignore[arg-type]
    p_refused = sum(p for t, p in free.items() if refusals[t])
    assert 0.3 < p_refused < 0.7  # both ways taken often
    allowed = {t: p for t, p in free.items() if not refusals[t]}
    expected = {
        t: allowed.get(t, 0.0) + p_refused * constrained.get(t, 0.0)
        for t in {*allowed, *constrained}
    }
    assert abs(sum(expected.values()) - 1) < 1e-9
    stat, dof = chi_square(draws, expected, n)
    assert chi2_sf(stat, dof) > 1e-3, (stat, dof, draws, expected)
