"""Adapters per request and control vectors: exact at scale 0, deterministic otherwise, refused
cleanly for another model, and parallel slots running different adapter sets side by side."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from llamacrab import (
    Batch,
    Context,
    ContextParams,
    ControlVector,
    DecodeError,
    InvalidModelError,
    InvalidParameterError,
    Llama,
    ModelLoadError,
    RamCache,
    SamplerChain,
    SamplingOptions,
)

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")

PROMPT = "the cat sat on the mat"
GREEDY = {"max_tokens": 12, "temperature": 0.0}
INVOCATION = [5, 6]  # tokens that invoke the tiny aLoRA adapter


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("adapters")
    return {
        "lora": tiny.write_tiny_lora(d / "lora.gguf"),
        "lora2": tiny.write_tiny_lora(d / "lora2.gguf", seed=7),
        "alora": tiny.write_tiny_lora(d / "alora.gguf", invocation_tokens=INVOCATION),
        "alora_plain": tiny.write_tiny_lora(d / "alora-plain.gguf"),  # same weights, no aLoRA
        "qwen_lora": tiny.write_tiny_lora(d / "qwen-lora.gguf", arch="qwen2"),
        "wide_lora": tiny.write_tiny_lora(d / "wide-lora.gguf", n_embd=96),
        "cvec": tiny.write_tiny_control_vector(d / "cvec.gguf"),
        "cvec_narrow": tiny.write_tiny_control_vector(d / "narrow.gguf", n_embd=32),
        "cvec_deep": tiny.write_tiny_control_vector(d / "deep.gguf", layers=(1, 2, 3, 4)),
        "cvec_qwen": tiny.write_tiny_control_vector(d / "qwen.gguf", model_hint="qwen2"),
    }


def prompt_logits(llm: Llama, prompt: str | list[int] = PROMPT, **kwargs: object) -> np.ndarray:
    """The logits after the whole prompt, decoded afresh (a reused prefix would decode the
    rest in another batch shape, whose arithmetic may differ in the last bits)."""
    llm.reset()
    llm.create_completion(prompt, max_tokens=0, **kwargs)  # type: ignore[arg-type]
    return llm.context.logits()


# -- control vectors ---------------------------------------------------------------------------


def test_control_vector_at_strength_zero_is_the_base_model_bit_for_bit(
    tiny_llama: Llama, files: dict[str, Path]
) -> None:
    base = prompt_logits(tiny_llama)
    tiny_llama.set_control_vector([(files["cvec"], 0.0)])
    assert np.array_equal(prompt_logits(tiny_llama), base)
    tiny_llama.set_control_vector(None)
    assert np.array_equal(prompt_logits(tiny_llama), base)


def test_control_vector_changes_the_logits_deterministically(
    tiny_llama: Llama, files: dict[str, Path]
) -> None:
    base = prompt_logits(tiny_llama)
    tiny_llama.set_control_vector([files["cvec"]])
    steered = prompt_logits(tiny_llama)
    assert not np.allclose(steered, base)
    tiny_llama.reset()
    assert np.array_equal(prompt_logits(tiny_llama), steered)
    # Two files add up: the vector at strength 0.5 twice is the vector at strength 1.
    tiny_llama.set_control_vector([(files["cvec"], 0.5), (files["cvec"], 0.5)])
    assert np.array_equal(prompt_logits(tiny_llama), steered)
    # Applied to no layer that holds a direction (layer 2 of 2 has none): the base model.
    tiny_llama.set_control_vector([files["cvec"]], layers=(2, 2))
    assert np.array_equal(prompt_logits(tiny_llama), base)


def test_control_vector_from_the_constructor(tiny_model_path: Path, files: dict[str, Path]) -> None:
    with Llama(tiny_model_path, n_ctx=128, n_threads=2) as llm:
        llm.set_control_vector([files["cvec"]], layers=(1, 2))
        steered = prompt_logits(llm)
    options = {"control_vectors": [str(files["cvec"])], "control_vector_layers": [1, 2]}
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, **options) as llm:
        vector, start, end = llm.context.control_vector  # type: ignore[misc]
        assert (vector.n_embd, start, end) == (64, 1, 2)
        assert np.array_equal(prompt_logits(llm), steered)


@pytest.mark.parametrize(
    ("name", "layers", "match"),
    [
        ("cvec_narrow", None, "32 values per layer; this model's n_embd is 64"),
        ("cvec_deep", None, "direction for layer 4; this model has 2 layers"),
        ("cvec_qwen", None, "made for a qwen2 model; this one is llama"),
        ("cvec", (0, 2), "layer range 0..2 is outside this model's layers 1..2"),
        ("cvec", (1, 3), "layer range 1..3 is outside this model's layers 1..2"),
        ("cvec", (2, 1), "layer range 2..1"),
    ],
)
def test_control_vector_for_another_model_or_layers_outside_it_is_a_clear_error(
    tiny_llama: Llama,
    files: dict[str, Path],
    name: str,
    layers: tuple[int, int] | None,
    match: str,
) -> None:
    base = prompt_logits(tiny_llama)
    with pytest.raises(InvalidParameterError, match=match):
        tiny_llama.set_control_vector([files[name]], layers=layers)
    assert tiny_llama.context.control_vector is None
    assert np.array_equal(prompt_logits(tiny_llama), base)


def test_malformed_control_vector_files_are_refused(
    tmp_path: Path, files: dict[str, Path], tiny_model_path: Path
) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(files["cvec"].read_bytes()[:-40])
    with pytest.raises(InvalidModelError, match="outside the file"):
        ControlVector.load([truncated])
    with pytest.raises(InvalidModelError, match="not a direction"):
        ControlVector.load([tiny_model_path])  # a model, not a control vector
    with pytest.raises(InvalidModelError, match="other files have"):
        ControlVector.load([files["cvec"], files["cvec_narrow"]])
    with pytest.raises(InvalidParameterError, match="not found"):
        ControlVector.load([tmp_path / "missing.gguf"])


@pytest.mark.parametrize("layer", [513, 100_000_000, 2**62])
def test_a_control_vector_layer_past_any_model_is_refused_before_allocating(
    tmp_path: Path, layer: int
) -> None:
    # The directions become one row per layer up to the highest: 10^8 rows were 24 GiB (a
    # MemoryError), 2^62 a ValueError from numpy.
    path = tiny.write_tiny_control_vector(tmp_path / "far.gguf", layers=(1, layer))
    with pytest.raises(InvalidModelError, match=rf"direction\.{layer}'.*layer 1\.\.512"):
        ControlVector.load([path])


@pytest.mark.parametrize(
    ("strength", "match"),
    [
        (float("nan"), "strength of control vector .* is nan"),
        (float("inf"), "is inf"),
        ("0.5", "must be a number, not '0.5'"),
        (None, "must be a number, not None"),
        (True, "must be a number, not True"),
        (1e39, "too large for 32-bit floats"),
    ],
)
def test_a_control_vector_strength_must_be_a_finite_number(
    tiny_llama: Llama, files: dict[str, Path], strength: object, match: str
) -> None:
    base = prompt_logits(tiny_llama)
    with pytest.raises(InvalidParameterError, match=match):
        tiny_llama.set_control_vector([(files["cvec"], strength)])  # type: ignore[list-item]
    assert tiny_llama.context.control_vector is None
    assert np.array_equal(prompt_logits(tiny_llama), base)


# -- LoRA per request --------------------------------------------------------------------------


def test_lora_per_request_at_scale_zero_is_the_base_model_bit_for_bit(
    tiny_model_path: Path, files: dict[str, Path]
) -> None:
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, lora=[str(files["lora"])]) as llm:
        (adapter,) = llm.adapters
        adapted = prompt_logits(llm)  # the default: scale 1
        base = prompt_logits(llm, lora={adapter: 0.0})
        assert not np.allclose(adapted, base)
        assert np.array_equal(prompt_logits(llm, lora={}), base)
        # The default set is untouched by a request's own.
        assert llm.lora_adapters == {adapter: 1.0}
        assert np.array_equal(prompt_logits(llm), adapted)
    with Llama(tiny_model_path, n_ctx=128, n_threads=2) as plain:
        assert np.array_equal(prompt_logits(plain), base)


def test_lora_per_request_is_deterministic_and_scales(
    tiny_model_path: Path, files: dict[str, Path]
) -> None:
    lora = [(str(files["lora"]), 0.0), (str(files["lora2"]), 0.0)]
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, lora=lora) as llm:
        one, two = llm.adapters
        half = prompt_logits(llm, lora={one: 0.5})
        full = prompt_logits(llm, lora={one: 1.0})
        both = prompt_logits(llm, lora={one: 1.0, two: 1.0})
        assert not np.allclose(half, full) and not np.allclose(full, both)
        llm.reset()
        assert np.array_equal(prompt_logits(llm, lora={one: 0.5}), half)
        assert np.array_equal(prompt_logits(llm, lora={two: 1.0, one: 1.0}), both)


def test_lora_per_request_never_reuses_kv_of_another_set(
    tiny_model_path: Path, files: dict[str, Path]
) -> None:
    cache = RamCache(capacity_bytes=64 << 20)
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, lora=[(str(files["lora"]), 0.0)],
               cache=cache) as llm:  # fmt: skip
        (adapter,) = llm.adapters
        reusable = len(llm.tokenize(PROMPT)) - 1
        assert llm.create_completion(PROMPT, max_tokens=0).usage.cached_tokens == 0
        again = llm.create_completion(PROMPT, max_tokens=0, lora={adapter: 1.0})
        assert again.usage.cached_tokens == 0
        llm.reset()  # only the cache can help now: it keeps a state per adapter set
        adapted = llm.create_completion(PROMPT, max_tokens=0, lora={adapter: 1.0})
        assert adapted.usage.cached_tokens == reusable
        assert llm.create_completion(PROMPT, max_tokens=0).usage.cached_tokens == reusable


def test_an_adapter_for_another_architecture_is_a_clear_error(
    tiny_llama: Llama, files: dict[str, Path], tiny_model_path: Path
) -> None:
    with pytest.raises(ModelLoadError, match="arch mismatch"):
        tiny_llama.load_lora(files["qwen_lora"])
    with pytest.raises(ModelLoadError, match="arch mismatch"):
        Llama(tiny_model_path, n_ctx=64, lora=[str(files["qwen_lora"])])
    with pytest.raises(ModelLoadError, match="incorrect shape"):  # another model's n_embd
        tiny_llama.load_lora(files["wide_lora"])
    assert tiny_llama.adapters == [] and tiny_llama.lora_adapters == {}
    with Llama(tiny_model_path, n_ctx=64, n_threads=2) as other:
        foreign = other.load_lora(files["lora"], scale=0.0)
        with pytest.raises(InvalidParameterError, match="another model"):
            tiny_llama.create_completion(PROMPT, max_tokens=1, lora={foreign: 1.0})
    own = tiny_llama.load_lora(files["lora"], scale=0.0)
    with pytest.raises(InvalidParameterError, match="not a number"):
        tiny_llama.create_completion(PROMPT, max_tokens=1, lora={own: float("nan")})


def test_parallel_slots_run_requests_with_different_adapter_sets(
    tiny_model_path: Path, files: dict[str, Path]
) -> None:
    lora = [(str(files["lora"]), 0.0), (str(files["lora2"]), 0.0)]
    with Llama(tiny_model_path, n_ctx=256, n_threads=2, lora=lora) as one:
        a, b = one.adapters
        sets = {"base": {}, "a": {a: 1.0}, "b": {b: 0.7}}
        reference = {
            name: one.create_completion(PROMPT, lora=s, **GREEDY).choices[0].tokens
            for name, s in sets.items()
        }
    assert len(set(reference.values())) == 3  # three different answers
    with Llama(tiny_model_path, n_ctx=3 * 256, n_threads=2, parallel=3, lora=lora) as llm:
        a, b = llm.adapters
        sets = {"base": {}, "a": {a: 1.0}, "b": {b: 0.7}}
        for _ in range(2):  # the second round reuses each slot's prompt where it may
            results: dict[str, tuple[int, ...]] = {}
            start = threading.Barrier(3)

            def run(
                name: str, results: dict[str, tuple[int, ...]], start: threading.Barrier
            ) -> None:
                start.wait()
                choice = llm.create_completion(PROMPT, lora=sets[name], **GREEDY).choices[0]
                results[name] = choice.tokens

            threads = [threading.Thread(target=run, args=(name, results, start)) for name in sets]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert results == reference


# -- aLoRA -------------------------------------------------------------------------------------


def test_alora_applies_from_its_invocation_tokens(
    tiny_model_path: Path, files: dict[str, Path]
) -> None:
    lora = [(str(files["alora"]), 0.0), (str(files["alora_plain"]), 0.0)]
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, lora=lora) as llm:
        alora, plain = llm.adapters
        assert alora.alora_invocation_tokens == tuple(INVOCATION)
        assert plain.alora_invocation_tokens == ()
        invoked = [1, 200, 201, 202, *INVOCATION, 203, 204]
        base = prompt_logits(llm, invoked)
        activated = prompt_logits(llm, invoked, lora={alora: 1.0})
        everywhere = prompt_logits(llm, invoked, lora={plain: 1.0})
        assert not np.allclose(activated, base) and not np.allclose(activated, everywhere)
        llm.reset()
        assert np.array_equal(prompt_logits(llm, invoked, lora={alora: 1.0}), activated)
        # The base model's KV of the prompt before the invocation is reused.
        prompt_logits(llm, invoked)
        reused = llm.create_completion(invoked, max_tokens=0, lora={alora: 1.0})
        assert reused.usage.cached_tokens == 4
        assert np.allclose(llm.context.logits(), activated, atol=1e-5)
        # Not invoked: the base model.
        plain_prompt = [1, 200, 201, 202, 203]
        expected = prompt_logits(llm, plain_prompt)
        assert np.array_equal(prompt_logits(llm, plain_prompt, lora={alora: 1.0}), expected)


def test_two_alora_adapters_at_once_are_refused(
    tiny_model_path: Path, files: dict[str, Path], tmp_path: Path
) -> None:
    second = tiny.write_tiny_lora(tmp_path / "alora2.gguf", seed=9, invocation_tokens=[7])
    lora = [(str(files["alora"]), 0.0), (str(second), 0.0)]
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, lora=lora) as llm:
        first, other = llm.adapters
        with pytest.raises(InvalidParameterError, match="aLoRA adapter runs alone"):
            llm.create_completion([1, 5, 6, 7], max_tokens=1, lora={first: 1.0, other: 1.0})


def test_a_lora_scale_that_overflows_is_a_decode_error_not_text(
    tiny_model_path: Path, files: dict[str, Path]
) -> None:
    # The logits came out NaN and every pick was the same arbitrary token, output as text
    # (found by a hostile-input hunt).
    with Llama(tiny_model_path, n_ctx=64, n_threads=1) as llm:
        expected = llm.create_completion("the cat", max_tokens=3, temperature=0).choices[0]
        adapter = llm.load_lora(files["lora"], scale=1e30)
        for sampling in ({"temperature": 0}, {"top_k": 5}, {"temperature": 0.7}):
            with pytest.raises(DecodeError, match="computed a logit of nan"):
                llm.create_completion("the cat", max_tokens=3, **sampling)
        llm.set_lora_adapters({adapter: 0.0})
        again = llm.create_completion("the cat", max_tokens=3, temperature=0).choices[0]
        assert again.tokens == expected.tokens


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_a_decode_that_overflowed_leaves_no_nan_for_the_prompts_after_it(
    tiny_model_path: Path, files: dict[str, Path], flash_attn: str
) -> None:
    # Freed cells kept the NaN it computed, and attention reads freed cells through its mask
    # (the CPU's flash attention in tiles of 64 rows, the V product without it): every prompt
    # after it whose attention reached them came out NaN, a context broken for good.
    prompt = [1, *(10 + i % 250 for i in range(150))]
    with Llama(tiny_model_path, n_ctx=256, n_threads=2, flash_attn=flash_attn,
               lora=[(str(files["lora"]), 0.0)]) as llm:  # fmt: skip
        (adapter,) = llm.adapters

        def greedy(n: int) -> list[int]:
            return llm.create_completion(prompt[-n:], max_tokens=3, temperature=0).choices[0].tokens

        expected = {n: greedy(n) for n in (8, 70, 100)}
        with pytest.raises(DecodeError, match="computed a logit of nan"):
            llm.create_completion(prompt, max_tokens=3, lora={adapter: 3e38})
        assert {n: greedy(n) for n in (70, 8, 100)} == expected


@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("freed_by", ["keep", "state load"])
def test_cells_an_overflow_left_are_zeroed_when_keep_or_a_state_load_frees_them(
    tiny_model_path: Path, files: dict[str, Path], flash_attn: str, freed_by: str
) -> None:
    # keep() and a sequence's state load free cells through llama.cpp's own removal, which
    # left the NaN an overflowing decode wrote in them for the next prompts to read.
    prompt = [1, *(10 + i % 250 for i in range(150))]
    with Llama(tiny_model_path, n_ctx=64, n_threads=2, lora=[(str(files["lora"]), 0.0)]) as llm:
        (adapter,) = llm.adapters
        params = ContextParams(n_ctx=512, n_batch=256, n_seq_max=2, kv_unified=True, n_threads=2,
                               flash_attn=flash_attn, graph_sampling="off")  # fmt: skip
        with Context(llm.model, params) as context, Batch(256, 2) as batch:

            def last_logits(tokens: list[int], seq_id: int, lora: float = 0.0) -> np.ndarray:
                context.remove(seq_id)
                batch.set(np.array(tokens, dtype=np.int32), 0, seq_id)
                context.decode(batch, {adapter: lora})
                return context.logits()

            expected = {n: last_logits(prompt[-n:], 0) for n in (8, 70, 100)}
            saved = context.state_bytes(0)  # the 100-token prompt's
            last_logits(prompt, 1, lora=3e38)
            chain = SamplerChain(llm.model, SamplingOptions(temperature=0))
            with chain, pytest.raises(DecodeError, match="computed a logit of nan"):
                chain.sample(context)
            if freed_by == "keep":
                context.keep(0)
            else:
                context.load_state_bytes(saved, 1)
            for n in (70, 8, 100):  # the cells in other places: sums in another order
                np.testing.assert_allclose(last_logits(prompt[-n:], 0), expected[n], atol=1e-5)
