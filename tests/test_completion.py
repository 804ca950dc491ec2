"""Text completion on Gemma 3 270M: content, seeds, stops, streaming, prefix reuse, async."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from llamacrab import Llama

pytestmark = pytest.mark.real_model

# Greedy output can differ at near-ties when a prompt is decoded in other chunks (as reusing a
# cached prefix does), so tests comparing texts start from an empty cache with reset().
GREEDY = {"temperature": 0.0}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def test_greedy_completion_of_a_factual_prompt(gemma: Llama) -> None:
    result = gemma.create_completion("Paris is the capital of", max_tokens=6, **GREEDY)
    assert result.text.startswith(" France")
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == len(gemma.tokenize("Paris is the capital of"))
    assert result.usage.completion_tokens == len(result.choices[0].tokens) == 6


def test_same_seed_same_text_different_seed_different_text(gemma: Llama) -> None:
    def sample(seed: int) -> str:
        gemma.reset()  # the same single prompt decode each time (see GREEDY)
        prompt = "Once upon a time"
        return gemma.create_completion(prompt, max_tokens=24, temperature=1.0, seed=seed).text

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_stop_string_is_never_emitted(gemma: Llama) -> None:
    full = gemma.create_completion("The capital of Germany is the city of", max_tokens=10, **GREEDY)
    assert "." in full.text
    cut = full.text[: full.text.index(".")]
    result = gemma.create_completion(
        "The capital of Germany is the city of", max_tokens=10, stop=".", **GREEDY
    )
    assert result.text == cut and result.choices[0].finish_reason == "stop"
    chunks = list(
        gemma.stream_completion(
            "The capital of Germany is the city of", max_tokens=10, stop=[". It"], **GREEDY
        )
    )
    assert "".join(c.text for c in chunks) == cut
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage is not None


def test_streaming_matches_non_streaming_and_early_break_leaves_llama_usable(gemma: Llama) -> None:
    prompt = "The three primary colours are"
    gemma.reset()
    whole = gemma.create_completion(prompt, max_tokens=12, **GREEDY).text
    gemma.reset()
    chunks = list(gemma.stream_completion(prompt, max_tokens=12, **GREEDY))
    assert "".join(c.text for c in chunks) == whole
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    for i, _ in enumerate(gemma.stream_completion("Count: one, two,", max_tokens=50, **GREEDY)):
        if i == 2:
            break
    gemma.reset()
    assert gemma.create_completion(prompt, max_tokens=12, **GREEDY).text == whole


def test_an_abandoned_stream_is_superseded_by_the_next_call(gemma: Llama) -> None:
    stream = gemma.stream_completion("Count: one, two,", max_tokens=50, **GREEDY)
    next(stream)
    result = gemma.create_completion("Paris is the capital of", max_tokens=3, **GREEDY)
    assert result.text.startswith(" France")
    rest = list(stream)
    assert rest[-1].finish_reason == "cancelled"


def test_shared_prefix_reuses_the_kv_cache_and_nothing_stale(
    gemma: Llama, gemma_path: Path
) -> None:
    base = "The following is a list of European capitals: Paris, Berlin, Madrid,"
    extended = base + " Rome, Vienna"
    # The shared model's memory from earlier tests would split base's first decode in two, and
    # another batch shape gives other float sums than the fresh model's below.
    gemma.reset()
    gemma.create_completion(base, max_tokens=2, **GREEDY)
    cached = list(gemma._completer.kv.tokens)
    gemma.create_completion(extended, max_tokens=0, **GREEDY)
    shared = len(gemma.tokenize(base))
    kv_tokens = gemma._completer.kv.tokens
    assert kv_tokens == gemma.tokenize(extended)  # stale generated tokens were dropped
    assert kv_tokens[:shared] == cached[:shared]
    reused_logits = gemma.context.logits()
    with Llama(gemma_path, n_ctx=1024, n_threads=2) as fresh:
        # The same two decodes without the generated tokens in between: bit-identical logits
        # prove the stale generated tokens were removed from the cache exactly.
        fresh.create_completion(base, max_tokens=0, **GREEDY)
        fresh.create_completion(extended, max_tokens=0, **GREEDY)
        assert np.array_equal(fresh.context.logits(), reused_logits)
        # One decode of the whole prompt: the same distribution up to float noise.
        fresh.reset()
        fresh.create_completion(extended, max_tokens=0, **GREEDY)
        single_pass = fresh.context.logits()
    assert np.corrcoef(reused_logits, single_pass)[0, 1] > 0.999
    top = np.argsort(single_pass)[-20:]
    drift = log_softmax(reused_logits)[top] - log_softmax(single_pass)[top]
    assert np.abs(drift).max() < 0.5


def test_a_prefix_is_reused_only_while_the_sliding_window_before_it_is_in_memory(
    gemma_path: Path,
) -> None:
    """Gemma 3's windowed layers keep 512 positions plus a batch (swa_full off, llama-server's
    choice): after 1,500 tokens they hold positions 476 on. A prefix of 1,400 still has its
    window and is reused; one of 600 lost it, so the prompt is decoded again in full. Both
    answer what a fresh memory answers."""
    text = " ".join(f"Item {i}: crab {i} lives on island {i % 13}." for i in range(200))
    with Llama(gemma_path, n_ctx=4096, n_threads=2) as llm:
        assert (llm.context.n_swa, llm.context.params.swa_full) == (512, False)
        tokens = llm.tokenize(text)[:1500]
        question = llm.tokenize(" Which island is crab 7 on?", add_special=False)
        llm.create_completion(tokens, max_tokens=0)
        oldest, newest = llm.context.positions(0) or (0, 0)
        assert newest == 1499 and oldest > 0  # older cells of windowed layers were reused
        answers = {}
        for shared in (1400, 600):
            prompt = tokens[:shared] + question
            answers[shared] = llm.create_completion(prompt, max_tokens=8, **GREEDY)
        assert answers[1400].usage.cached_tokens == 1400
        assert answers[600].usage.cached_tokens == 0, "reused without its window"
        for shared, answer in answers.items():
            llm.reset()
            fresh = llm.create_completion(tokens[:shared] + question, max_tokens=8, **GREEDY)
            assert answer.choices[0].tokens == fresh.choices[0].tokens
        llm.create_completion(tokens, max_tokens=0)
        assert not llm.context.remove(0, 600, -1)  # the window before 600 is gone
        llm.reset()
        llm.create_completion(tokens, max_tokens=0)
        assert llm.context.remove(0, 1400, -1)


def test_echo_and_token_prompts(gemma: Llama) -> None:
    tokens = gemma.tokenize("Paris is the capital of")
    result = gemma.create_completion(tokens, max_tokens=2, echo=True, **GREEDY)
    assert result.text.startswith("Paris is the capital of France")


def test_echo_with_logprobs_rates_every_prompt_token(
    gemma: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = "The capital of France is Paris, and the capital of Italy is"
    tokens = gemma.tokenize(prompt)  # BOS first: listed as the echoed text has it, empty
    gemma.create_completion(prompt, max_tokens=1)  # in memory now: it is decoded again anyway
    result = gemma.create_completion(prompt, max_tokens=2, echo=True, logprobs=3, **GREEDY)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and result.usage.cached_tokens == 0
    n = len(tokens)  # values line up with the prompt's tokens: nothing rates the first
    assert len(logprobs.tokens) == n + 2 and "".join(logprobs.tokens[:n]) == prompt
    assert logprobs.tokens[0] == "" and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    for i in range(4):
        assert logprobs.text_offset[i] == len("".join(logprobs.tokens[:i]))
    assert logprobs.text_offset[n] == len(prompt)
    # Each value is what the prefix before the token predicts, decoded alone (up to the
    # arithmetic of other batch shapes, 0.17 apart on an AVX-512 machine; a row off would be
    # nats away, see test_compat's echo test).
    for k in (1, n // 2, n - 1):
        gemma.reset()
        gemma.create_completion(tokens[:k], max_tokens=0)
        expected = log_softmax(gemma.context.logits())[tokens[k]]
        value, top = logprobs.token_logprobs[k], logprobs.top_logprobs[k]
        assert value is not None and abs(value - expected) < 0.3
        assert top is not None and len(top) == 3
    # Read in decodes of 2 rows (the cap on the logits one decode returns): the same values.
    monkeypatch.setattr("llamacrab._engine.logprobs._PROMPT_LOGITS_BYTES", 8 * gemma.vocab.n_tokens)
    chunked = gemma.create_completion(prompt, max_tokens=2, echo=True, logprobs=3, **GREEDY)
    assert chunked.choices[0].logprobs is not None
    drift = np.subtract(chunked.choices[0].logprobs.token_logprobs[1:n],
                        logprobs.token_logprobs[1:n])  # fmt: skip
    assert np.abs(drift).max() < 0.3


def test_async_stream_does_not_block_the_event_loop(gemma: Llama) -> None:
    async def main() -> tuple[str, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        text = ""
        async for chunk in gemma.astream_completion(
            "Paris is the capital of", max_tokens=8, **GREEDY
        ):
            text += chunk.text
        task.cancel()
        return text, ticks

    text, ticks = asyncio.run(main())
    assert text.startswith(" France") and ticks > 5


@pytest.mark.parametrize("parallel", [None, 2])
def test_usage_times_the_prompt_and_the_generation(
    tiny_model_path: Path, parallel: int | None
) -> None:
    with Llama(tiny_model_path, n_ctx=512, parallel=parallel) as llm:
        prompt = "the cat sat on the mat " * 8
        started = time.monotonic()
        usage = llm.create_completion(prompt, max_tokens=12, temperature=0).usage
        elapsed = time.monotonic() - started
        assert usage.prompt_seconds > 0 and usage.generation_seconds > 0
        assert usage.prompt_seconds + usage.generation_seconds <= elapsed
        # Streamed, the last chunk carries them; nothing to generate, nothing timed after.
        last = list(llm.stream_completion(prompt + "x", max_tokens=0))[-1].usage
        assert last is not None and last.prompt_seconds > 0 and last.generation_seconds == 0
        # A cancelled generation that never began reads nothing.
        stream = llm.stream_completion(prompt, max_tokens=4)
        stream.cancel()
        assert [c.usage.prompt_seconds for c in stream if c.usage] in ([0.0], [])


@pytest.mark.parametrize("parallel", [None, 2])
def test_every_streamed_chunk_has_its_usage_so_far(
    tiny_model_path: Path, parallel: int | None
) -> None:
    """The tokens and times up to each chunk (llama-server's timings_per_token), the last
    chunk's equal to its usage; chat deltas carry them on."""
    with Llama(tiny_model_path, n_ctx=512, parallel=parallel) as llm:
        options = {"grammar": r'root ::= "abcdef"', "temperature": 0, "max_tokens": 20}
        chunks = list(llm.stream_completion("the cat", **options))
        so_far = [c.usage_so_far for c in chunks]
        # Six tokens, then the end of the grammar (a chunk without a token).
        assert [u.completion_tokens if u else None for u in so_far] == [1, 2, 3, 4, 5, 6, 6]
        assert so_far[-1] == chunks[-1].usage and not any(c.usage for c in chunks[:-1])
        assert len({(u.prompt_tokens, u.prompt_seconds) for u in so_far if u}) == 1
        times = [u.generation_seconds for u in so_far if u]
        assert times == sorted(times) and times[0] == 0
        chat = [{"role": "user", "content": "hi"}]
        deltas = list(llm.stream_chat_completion(chat, chat_format="chatml", **options))
        assert [d.usage_so_far.completion_tokens if d.usage_so_far else None
                for d in deltas] == [1, 2, 3, 4, 5, 6, 6]  # fmt: skip
