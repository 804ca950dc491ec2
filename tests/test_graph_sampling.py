"""Sampling inside the compute graph (graph_sampling): same greedy tokens as the CPU chain, the
same distribution, the CPU chain kept for what the graph cannot run, slots and states intact."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from live_server import LiveServer

from llamacrab import CustomSampler, InvalidParameterError, Llama, SamplingOptions
from llamacrab._native.batch import Batch
from llamacrab._native.devices import accelerator_present
from llamacrab._native.sampler import Samplers, graph_fits, greedy_filters
from llamacrab.server import parse_settings

from support import chain_distribution, chi2_sf, chi_square

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def test_which_chains_fit() -> None:
    fits = lambda **kw: graph_fits(SamplingOptions(**kw), 1000)  # noqa: E731
    assert fits()  # llama.cpp's defaults: top_k 40, top_p, min_p, temperature, dist
    assert fits(temperature=0) and fits(temperature=0, logit_bias={3: -5.0})
    assert fits(dynatemp_range=0.5) and fits(top_k=0) and fits(top_k=0, top_p=1.0, min_p=0.0)
    assert fits(repeat_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)
    # A greedy pick after the penalties: the filters after them keep the most likely token,
    # so the chain holds none; top_k or top_p before them hand the pick no token ids.
    assert fits(temperature=0, repeat_penalty=1.3)
    assert greedy_filters(SamplingOptions(temperature=0, repeat_penalty=1.3)) == ["penalties"]
    assert fits(temperature=0, repeat_penalty=1.3, order=("min_p", "penalties", "temperature"))
    for first in ("top_k", "top_p"):
        order = (first, "penalties", "temperature")
        assert not fits(temperature=0, repeat_penalty=1.3, top_p=0.9, order=order), first
    for blocker in ({"grammar": "root ::= [a-z]+"}, {"mirostat": 2}, {"dry_multiplier": 0.8},
                    {"top_n_sigma": 1.0}, {"typical_p": 0.9}, {"xtc_probability": 0.5},
                    {"adaptive_p_target": 0.5}, {"infill": True}, {"top_k": 1001},
                    {"custom_samplers": (CustomSampler(),)}):  # fmt: skip
        assert not fits(**blocker), blocker
    with pytest.raises(InvalidParameterError, match="graph_sampling"):
        Llama(Path("unused.gguf"), graph_sampling="always")


def test_auto_samples_in_the_graph_only_with_an_accelerator(
    tiny_model_path: Path, bound: list[bool]
) -> None:
    # On the CPU backend the graph's sampling costs more than the CPU chain, so "auto" keeps
    # the chain on the CPU; with the output layer on a GPU it saves copying the logits back.
    gpu = accelerator_present()
    with Llama(tiny_model_path, n_ctx=128, n_threads=2) as llm:
        assert llm.context.params.graph_sampling == "auto"
        assert llm.context.graph_sampling == ("on" if gpu else "off")
        llm.create_completion("the cat", max_tokens=2, temperature=0)
    assert bound == [gpu]


def _texts(llm: Llama, prompts: list[str], **options: object) -> list[tuple[int, ...]]:
    return [
        llm.create_completion(p, max_tokens=24, **options).choices[0].tokens  # type: ignore[arg-type]
        for p in prompts
    ]


def test_greedy_tokens_match_the_cpu_chain_tiny(tiny_model_path: Path, bound: list[bool]) -> None:
    results = {}
    for mode in ("off", "on"):
        with Llama(tiny_model_path, n_ctx=128, n_threads=2, graph_sampling=mode) as llm:
            results[mode] = _texts(llm, ["the cat sat", "a b c", "on the mat"], temperature=0)
            # logit bias runs in the graph too
            results[mode + "-bias"] = _texts(llm, ["the cat"], temperature=0,
                                             logit_bias={5: 10.0, 6: -100.0})  # fmt: skip
    assert results["off"] == results["on"]
    assert results["off-bias"] == results["on-bias"]
    assert bound == [False] * 4 + [True] * 4


def test_logits_are_read_or_refused_never_stale(tiny_model_path: Path, bound: list[bool]) -> None:
    # Where every output of a decode samples in the graph, llama.cpp copies no logits: the
    # buffer would hold an older decode's (seen on a GPU, where "auto" samples in the graph).
    prompts = ("the cat sat on", "a b c d e")
    logits = {}
    for mode in ("off", "on"):
        with Llama(tiny_model_path, n_ctx=128, n_threads=2, graph_sampling=mode) as llm:
            for prompt in prompts:  # a prompt alone samples nothing: its logits are read
                llm.create_completion(prompt, max_tokens=0)
                logits[mode, prompt] = llm.context.logits()
            llm.create_completion("the cat", max_tokens=3, temperature=0)
            if mode == "on":
                with pytest.raises(InvalidParameterError, match="inside the compute graph"):
                    llm.context.logits()
            else:
                assert llm.context.logits().shape == (llm.vocab.n_tokens,)
            llm.create_completion("the cat", max_tokens=0)  # readable again
            assert llm.context.logits().shape == (llm.vocab.n_tokens,)
    for prompt in prompts:
        assert np.array_equal(logits["off", prompt], logits["on", prompt])
    assert not np.array_equal(logits["on", prompts[0]], logits["on", prompts[1]])
    assert bound == [False] * 4 + [False, False, True, False]


def test_penalties_in_the_graph_match_the_cpu_chain(
    tiny_model_path: Path, bound: list[bool]
) -> None:
    results = {}
    # top_k 1 after the penalties picks their argmax (temperature 0: see the Gemma test below)
    options = {"repeat_penalty": 1.5, "frequency_penalty": 0.4, "presence_penalty": 0.3,
               "penalty_last_n": 8, "top_k": 1, "seed": 5}  # fmt: skip
    for mode in ("off", "on"):
        with Llama(tiny_model_path, n_ctx=128, n_threads=2, graph_sampling=mode) as llm:
            results[mode] = _texts(llm, ["the cat sat", "a b c"], **options)
            results[mode + "-greedy"] = _texts(llm, ["the cat sat"], top_k=1, seed=5)
    assert results["off"] == results["on"]
    assert results["off"][0] != results["off-greedy"][0]  # the penalties changed something
    assert bound == [False] * 3 + [True] * 3


@pytest.mark.real_model
def test_greedy_tokens_match_the_cpu_chain_gemma(gemma_path: Path, bound: list[bool]) -> None:
    penalized = {"repeat_penalty": 1.3, "frequency_penalty": 0.2, "top_k": 1, "seed": 3}
    with Llama(gemma_path, n_ctx=1024, n_threads=2, graph_sampling="on") as graph:
        in_graph = _texts(graph, PROMPTS, temperature=0)
        in_graph_penalized = _texts(graph, PROMPTS[:2], **penalized)
        sampled = _texts(graph, PROMPTS[:1], temperature=0.7, seed=11)
    assert bound == [True] * 6
    # Fresh memory on both sides: a prefix left in memory would decode the prompts in other
    # batch shapes, whose float sums can flip a near tie. "off", not "auto": on a GPU "auto"
    # samples in the graph too.
    with Llama(gemma_path, n_ctx=1024, n_threads=2, graph_sampling="off") as cpu:
        assert _texts(cpu, PROMPTS, temperature=0) == in_graph
        assert _texts(cpu, PROMPTS[:2], **penalized) == in_graph_penalized
        # Not promised (float sums differ), but a seeded run usually agrees token for token.
        _texts(cpu, PROMPTS[:1], temperature=0.7, seed=11)
    assert bound[6:] == [False] * 6
    assert all(len(t) == 24 for t in in_graph + sampled)


REPEAT = (
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps "
    "over the lazy dog."
)
# Each changes Gemma 3's greedy answer to REPEAT once the prompt's tokens count.
PENALTIES = [{"repeat_penalty": 1.3}, {"frequency_penalty": 1.0}, {"presence_penalty": 2.0},
             {"dry_multiplier": 0.8}]  # fmt: skip


@pytest.mark.real_model
def test_a_greedy_pick_after_penalties_matches_the_cpu_chain(
    gemma_path: Path, bound: list[bool]
) -> None:
    # Found by a helper: at temperature 0 with a penalty, the graph generated token 0 every
    # time. The chain was penalties, top_k, top_p, min_p, greedy, and llama.cpp's greedy in
    # the graph returns the argmax's position among top_k's candidates (sorted: 0), not its
    # token id. The filters after the penalties keep the most likely token and now stay out
    # of a greedy chain; a greedy pick after top_k or top_p stays on the CPU.
    picks = [{"temperature": 0}, {"temperature": 0.5, "top_k": 1, "seed": 3}]
    cases = [{**pick, **penalty} for penalty in PENALTIES for pick in picks]
    cases.append({"temperature": 0, "repeat_penalty": 1.3, "top_k": 2,
                  "order": ("top_k", "penalties", "temperature")})  # fmt: skip
    tokens = {}
    for mode in ("on", "off"):
        with Llama(gemma_path, n_ctx=256, n_threads=2, graph_sampling=mode) as llm:
            tokens[mode] = [
                llm.create_completion(REPEAT, max_tokens=10, penalize_prompt=True, **case)
                .choices[0].tokens
                for case in cases
            ]  # fmt: skip
            plain = llm.create_completion(REPEAT, max_tokens=10, temperature=0).choices[0].tokens
    assert tokens["on"] == tokens["off"]
    assert all(penalized != plain for penalized in tokens["off"])  # each penalty did something
    in_graph = ["dry_multiplier" not in case and "order" not in case for case in cases]
    assert bound == [*in_graph, True] + [False] * (len(cases) + 1)


def _draws(tiny_model_path: Path, mode: str, options: SamplingOptions, n: int) -> list[int]:
    """``n`` tokens sampled after the same prompt: the last prompt token is decoded again
    for each draw (the chain's random state moves on)."""
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, graph_sampling=mode) as llm:
        context, vocab = llm.context, llm.vocab
        prompt = np.asarray(vocab.tokenize("the cat sat on"), dtype=np.int32)
        samplers = Samplers(llm.model, options, 0, mode)
        samplers.bind(context, 0)
        assert samplers.in_graph == (mode == "on")
        batch = Batch(64, 1)
        batch.set(prompt[:-1], 0, 0, False)
        context.decode(batch)
        tokens = []
        for _ in range(n):
            context.remove(0, len(prompt) - 1, -1)
            batch.set_one(int(prompt[-1]), len(prompt) - 1, 0)
            context.decode(batch)
            tokens.append(samplers.sample(context))
        logits = None if samplers.in_graph else context.logits()
        samplers.unbind()
        samplers.close()
        if logits is not None:
            _draws.logits = logits  # type: ignore[attr-defined]
        return tokens


def test_sampled_distribution_matches_the_softmax(tiny_model_path: Path) -> None:
    """Both paths' token frequencies over 3,000 seeded draws against the probabilities the
    chain defines (numpy, from the logits). Fixed seeds: the outcome is the same every run."""
    n = 3000
    options = SamplingOptions(top_k=12, top_p=0.9, min_p=0.02, temperature=0.8, seed=1234)
    cpu = _draws(tiny_model_path, "off", options, n)
    logits = _draws.logits  # type: ignore[attr-defined]
    graph = _draws(tiny_model_path, "on", options, n)
    expected = chain_distribution(logits, 12, 0.9, 0.02, 0.8)
    assert len(expected) >= 4  # a real distribution, not a near-greedy one
    for tokens in (cpu, graph):
        counts: dict[int, int] = {}
        for t in tokens:
            counts[t] = counts.get(t, 0) + 1
        stat, dof = chi_square(counts, expected, n)
        assert chi2_sf(stat, dof) > 1e-3, (stat, dof, counts, expected)
    # The two paths draw the same uniform numbers from the same seed.
    agree = sum(a == b for a, b in zip(cpu, graph, strict=True)) / n
    assert agree > 0.95


@pytest.mark.parametrize(
    "options",
    [
        {"grammar": 'root ::= "the" " cat"*'},
        {"dry_multiplier": 0.8},
        {"mirostat": 2},
        {"min_tokens": 3},
        {"logprobs": 2},
        {"top_k": 100000},
        {"top_k": 0, "top_p": 0.9},
    ],
)
def test_unsupported_chains_fall_back_to_the_cpu(
    tiny_model_path: Path, bound: list[bool], options: dict
) -> None:
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, graph_sampling="on") as llm:
        result = llm.create_completion("the cat", max_tokens=4, seed=3, **options)
        assert result.choices[0].finish_reason in ("length", "eos", "stop")
        assert bound == [options.get("top_k") == 0]  # a whole-vocabulary top_p fits
        # The context holds no chain after the generation: raw logits are back.
        assert llm.context.graph_sampler(0) is None


def test_a_custom_sampler_samples_on_the_cpu(tiny_model_path: Path, bound: list[bool]) -> None:
    class Ban(CustomSampler):
        def apply(self, candidates: np.ndarray) -> None:
            candidates["logit"][5] = -np.inf

    with Llama(tiny_model_path, n_ctx=128, n_threads=2, graph_sampling="on") as llm:
        result = llm.create_completion(
            "the cat", max_tokens=6, temperature=0, custom_samplers=(Ban(),)
        )
    tokens = result.choices[0].tokens
    assert 5 not in tokens and bound == [False]


def test_parallel_slots_sample_in_the_graph(tiny_model_path: Path, bound: list[bool]) -> None:
    prompts = ["the cat sat", "a b c d", "on the mat", "the dog"]
    results: dict[str, list[tuple[int, ...]]] = {}
    for mode in ("off", "on"):
        with Llama(tiny_model_path, n_ctx=256, n_threads=2, parallel=2,
                   graph_sampling=mode) as llm:  # fmt: skip
            out: dict[int, tuple[int, ...]] = {}

            def run(i: int, llm: Llama = llm, out: dict = out) -> None:
                # greedy and seeded alternate: a batch mixes graph and CPU rows (logprobs)
                options = {"temperature": 0} if i % 2 else {"seed": i, "logprobs": 1}
                result = llm.create_completion(prompts[i], max_tokens=12, **options)
                out[i] = result.choices[0].tokens

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            results[mode] = [out[i] for i in range(len(prompts))]
            assert all(llm.context.graph_sampler(s) is None for s in (0, 1))
    assert results["off"] == results["on"]
    assert sorted(bound) == [False] * 6 + [True] * 2


def test_state_save_and_restore_with_graph_sampling(
    tiny_model_path: Path, bound: list[bool]
) -> None:
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, graph_sampling="on") as tiny_llama:
        _save_and_restore(tiny_llama)
    assert bound and all(bound)


def _save_and_restore(tiny_llama: Llama) -> None:
    first = tiny_llama.create_completion("the cat sat", max_tokens=8, temperature=0)
    state = tiny_llama.save_state()
    following = tiny_llama.create_completion("the cat sat" + first.choices[0].text,
                                             max_tokens=8, temperature=0)  # fmt: skip
    tiny_llama.reset()
    tiny_llama.load_state(state)
    again = tiny_llama.create_completion("the cat sat" + first.choices[0].text,
                                         max_tokens=8, temperature=0)  # fmt: skip
    assert again.choices[0].tokens == following.choices[0].tokens
    assert again.usage.cached_tokens > 0


def test_speculative_decoding_samples_on_the_cpu(tiny_model_path: Path, bound: list[bool]) -> None:
    results = {}
    for mode in ("off", "on"):
        with Llama(tiny_model_path, n_ctx=256, n_threads=2, prompt_lookup=3,
                   graph_sampling=mode) as llm:  # fmt: skip
            prompt = "the cat sat on the mat the cat sat on the mat the cat"
            results[mode] = llm.create_completion(prompt, max_tokens=16, temperature=0)
    assert results["off"].choices[0].tokens == results["on"].choices[0].tokens
    assert bound == [False, False]  # one output per sequence and decode in the graph


def test_a_closed_chain_is_taken_out_before_the_next_decode(tiny_model_path: Path) -> None:
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, graph_sampling="on") as llm:
        context = llm.context
        samplers = Samplers(llm.model, SamplingOptions(temperature=0), 0, "on")
        samplers.bind(context, 0)
        assert context.graph_sampler(0) is samplers.main
        samplers.close()  # freed while llama.cpp still holds it: never run again
        batch = Batch(64, 1)
        batch.set(np.asarray(llm.vocab.tokenize("the cat"), dtype=np.int32), 0, 0, True)
        context.decode(batch)
        assert context.graph_sampler(0) is None
        assert np.isfinite(context.logits()).all()  # raw logits again


def test_superseded_and_abandoned_streams(tiny_model_path: Path, bound: list[bool]) -> None:
    llm = Llama(tiny_model_path, n_ctx=128, n_threads=2, graph_sampling="on")
    first = llm.stream_completion("the cat", max_tokens=20, temperature=0)
    next(iter(first))
    # A newer generation on the CPU chain takes the sequence over; the older one ends.
    second = llm.create_completion("a b", max_tokens=4, temperature=0, logprobs=1)
    assert second.choices[0].finish_reason in ("length", "eos")
    assert [c.finish_reason for c in first][-1] == "cancelled"
    third = llm.stream_completion("the dog", max_tokens=20, temperature=0)
    next(iter(third))
    assert llm.context.graph_sampler(0) is not None
    llm.close()  # a stream still holding its chain in the graph
    assert bound == [True, False, True]


@pytest.mark.parametrize("mode", ["on", "off"])
def test_serve_takes_graph_sampling(tiny_model_path: Path, bound: list[bool], mode: str) -> None:
    settings = parse_settings(
        [str(tiny_model_path), "--graph-sampling", mode, "--n-ctx", "256"], {}
    )
    server = LiveServer(settings)
    try:
        assert server.wait_until_loaded() == 200
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        server.close()
    assert bound == [mode == "on"]
    with pytest.raises(InvalidParameterError, match="graph_sampling"):
        parse_settings([str(tiny_model_path), "--graph-sampling", "always"], {})
