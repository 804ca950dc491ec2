"""llamacrab.compat where llama-cpp-python's behaviour was lost or refused (an audit's
findings): generate(reset=False), the context's tokens as attributes, legacy function
messages, default-meaning keyword values, empty stop strings, chat format names, and
llama_grammar's ready grammars."""

from __future__ import annotations

import itertools
import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llamacrab import ContextError, InvalidParameterError
from llamacrab.compat import Llama, LlamaGrammar, UnsupportedParameterError

pytestmark = pytest.mark.real_model

CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
QUESTION = {"role": "user", "content": "Weather in Paris?"}


@pytest.fixture(scope="module")
def llm(gemma_path: Path) -> Iterator[Llama]:
    with Llama(model_path=str(gemma_path), n_ctx=512, n_threads=2, verbose=False) as llm:
        yield llm


def greedy(llm: Llama, tokens: list[int], count: int, reset: bool = True) -> list[int]:
    """The first ``count`` tokens ``generate`` yields, the generator then closed."""
    tokens_out = llm.generate(tokens, temp=0, reset=reset)
    try:
        return list(itertools.islice(tokens_out, count))
    finally:
        tokens_out.close()


def test_generate_without_reset_continues_the_sequence_the_context_holds(llm: Llama) -> None:
    # It was ignored: the second half started a new sequence from its one token.
    prompt = llm.tokenize(b"Count: 1, 2, 3,")
    whole = greedy(llm, prompt, 8)
    first = greedy(llm, prompt, 4)
    # The last token yielded was never decoded: llama-cpp-python's callers pass it on.
    second = greedy(llm, [first[-1]], 4, reset=False)
    assert first + second == whole
    assert llm.detokenize(whole).startswith(b" 4, 5,")


def test_generate_yields_the_end_token_it_sampled(llm: Llama) -> None:
    """As llama-cpp-python's generate() yields every token it samples: Gemma's chat turns end
    with <end_of_turn>, which was yielded as the vocabulary's <eos>."""
    end_of_turn = llm.tokenize(b"<end_of_turn>", add_bos=False, special=True)
    assert len(end_of_turn) == 1 and end_of_turn[0] != llm.token_eos()
    prompt = llm.tokenize(b"Count: 1, 2, 3,")

    def ended_with(end: int) -> list[int]:
        def end_after_two(input_ids: Any, scores: Any) -> Any:
            if len(input_ids) >= len(prompt) + 2:
                scores[end] = scores.max() + 10  # the greedy pick from the third token on
            return scores

        return list(llm.generate(prompt, temp=0, logits_processor=end_after_two))

    at_end_of_turn = ended_with(end_of_turn[0])
    assert len(at_end_of_turn) == 3 and at_end_of_turn[-1] == end_of_turn[0]
    assert ended_with(llm.token_eos()) == [*at_end_of_turn[:2], llm.token_eos()]


def test_the_context_tokens_are_read_only_attributes(llm: Llama) -> None:
    # They were missing (AttributeError): n_tokens, input_ids, scores, eval_tokens, ...
    prompt = llm.tokenize(b"Count: 1, 2, 3,")
    first = greedy(llm, prompt, 3)
    held = prompt + first[:2]  # the last token yielded is not decoded yet
    assert llm.n_tokens == len(held)
    assert llm._input_ids.tolist() == held and list(llm.eval_tokens) == held
    assert llm.input_ids.shape == (llm.n_ctx(),) and llm.input_ids.dtype == np.intc
    assert llm.input_ids[: llm.n_tokens].tolist() == held
    assert not llm.input_ids[llm.n_tokens :].any()
    with pytest.raises(ValueError, match="read-only"):
        llm.input_ids[0] = 1
    # A completion's tokens have no logits kept (llama.cpp samples them): zeros, never
    # made-up ones. eval() keeps them (test_eval_and_sample_...).
    assert llm.scores.shape == (len(held), llm.n_vocab()) and llm.scores.dtype == np.single
    assert not llm.scores.any()
    assert llm.eval_logits.maxlen == 1 and not any(llm.eval_logits[0])
    llm.reset()
    assert llm.n_tokens == 0 and not llm.input_ids.any()


def test_eval_and_sample_are_llama_cpp_python_s_hand_written_loop(llm: Llama) -> None:
    # They raised UnsupportedParameterError; code written for llama-cpp-python loops on them.
    prompt = llm.tokenize(b"The capital of France is")
    llm.reset()
    llm.eval(prompt)
    picked: list[int] = []
    for _ in range(6):
        picked.append(llm.sample(temp=0))
        llm.eval(picked[-1:])
    assert llm._input_ids.tolist() == prompt + picked
    assert llm.scores.shape == (len(prompt) + 6, llm.n_vocab())
    assert llm.scores[-1].any() and not llm.scores[:-1].any()  # the last row alone
    llm.reset()
    completion: Any = llm.create_completion("The capital of France is", max_tokens=6,
                                            temperature=0)  # fmt: skip
    assert llm.detokenize(picked).decode() == completion["choices"][0]["text"]


def test_sample_counts_the_held_tokens_and_runs_logits_processors(llm: Llama) -> None:
    counting = llm.tokenize(b"one two three four one two three four one")
    llm.reset()
    llm.eval(counting)
    two = llm.tokenize(b" two", add_bos=False)[0]
    assert llm.sample(temp=0) == two
    # llama-cpp-python's fresh chain counted no tokens, so its penalties did nothing.
    assert llm.sample(temp=0, repeat_penalty=50.0) not in counting
    banana = llm.tokenize(b" banana", add_bos=False)[0]

    def favour_banana(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        assert input_ids.tolist() == counting
        scores[banana] += 100.0
        return scores

    assert llm.sample(temp=0, logits_processor=favour_banana) == banana


def test_setting_n_tokens_rewinds_the_next_eval(llm: Llama) -> None:
    # llama-cpp-python's callers rewind so (its own reset() sets 0); it raised AttributeError.
    first, second = llm.tokenize(b"Count: one, two,"), llm.tokenize(b" red", add_bos=False)
    llm.reset()
    llm.eval(first + second)
    llm.n_tokens = len(first)
    assert llm.n_tokens == len(first) and llm._input_ids.tolist() == first
    third = llm.tokenize(b" three", add_bos=False)
    llm.eval(third)
    assert llm._input_ids.tolist() == first + third
    llm.n_tokens = 0
    assert llm.n_tokens == 0 and not llm.input_ids.any()
    llm.eval(first)
    assert llm._input_ids.tolist() == first
    with pytest.raises(InvalidParameterError, match="n_tokens"):
        llm.n_tokens = len(first) + 1


def test_sample_refuses_what_it_cannot_pick_from(llm: Llama) -> None:
    llm.reset()
    with pytest.raises(InvalidParameterError, match=r"logits of the last eval\(\)"):
        llm.sample()
    llm.eval(llm.tokenize(b"Hello"))
    with pytest.raises(UnsupportedParameterError, match="grammar"):
        llm.sample(grammar=LlamaGrammar.from_string('root ::= "a"'))
    llm.create_completion("Hello there", max_tokens=2)  # the context's logits are its own now
    with pytest.raises(InvalidParameterError, match="changed since"):
        llm.sample()
    # The same tokens loaded back after another request's decode: their logits are gone (a red
    # team saw sample() pick from the other request's).
    llm.reset()
    llm.eval(llm.tokenize(b"Hello"))
    saved = llm.save_state()
    llm.create_completion("Something else", max_tokens=2)
    llm.load_state(saved)
    with pytest.raises(InvalidParameterError, match="changed since"):
        llm.sample()


def test_logits_all_keeps_a_row_per_evaluated_token(gemma_path: Path) -> None:
    with Llama(model_path=str(gemma_path), n_ctx=256, n_threads=2, logits_all=True,
               verbose=False) as scored:  # fmt: skip
        tokens = scored.tokenize(b"The quick brown fox")
        scored.eval(tokens[:2])
        scored.eval(tokens[2:])
        rows = scored.scores
        assert rows.shape == (len(tokens), scored.n_vocab()) and all(row.any() for row in rows)
        assert len(scored.eval_logits) == len(tokens)
        direct = scored.llamacrab
        direct.reset()
        assert np.array_equal(direct.evaluate(tokens[:2], all_logits=True), rows[:2])
        assert scored.scores.shape == (2, scored.n_vocab())  # what the context holds now


def chat_usage(llm: Llama, messages: list[dict[str, Any]]) -> tuple[Any, Any]:
    result: Any = llm.create_chat_completion(messages, max_tokens=4, temperature=0)
    return result["usage"], result["choices"][0]["message"]


def test_legacy_function_messages_are_tool_messages(llm: Llama) -> None:
    # A "function" message was refused by role; an assistant's function_call was dropped.
    modern_call = {"role": "assistant", "content": None,
                   "tool_calls": [{"type": "function", "function": CALL}]}  # fmt: skip
    modern_result = {"role": "tool", "name": "get_weather", "content": "sunny"}
    legacy_call = {"role": "assistant", "content": None, "function_call": CALL}
    legacy_result = {"role": "function", "name": "get_weather", "content": "sunny"}
    modern = chat_usage(llm, [QUESTION, modern_call, modern_result])
    assert chat_usage(llm, [QUESTION, legacy_call, legacy_result]) == modern
    assert chat_usage(llm, [QUESTION, legacy_call]) == chat_usage(llm, [QUESTION, modern_call])
    # A response appended to the history carries both: the call is shown once.
    answered = {**modern_call, "function_call": CALL}
    assert chat_usage(llm, [QUESTION, answered, legacy_result]) == modern


def test_zero_threads_and_no_seed_ask_for_the_defaults(tiny_model_path: Path) -> None:
    # llama-cpp-python reads 0 and None as "the default"; they were refused.
    path = str(tiny_model_path)
    with (
        Llama(path, n_ctx=64, n_threads=0, n_threads_batch=0, seed=None, verbose=False) as tiny,
        Llama(path, n_ctx=64, verbose=False) as default,
    ):
        threads = (tiny.n_threads, tiny.n_threads_batch)
        assert threads == (default.n_threads, default.n_threads_batch)
        sampled = tiny("the cat", max_tokens=4)["choices"]
        assert sampled == default("the cat", max_tokens=4)["choices"]


def test_an_empty_stop_string_is_refused_by_name(llm: Llama) -> None:
    # It was dropped, where llama-cpp-python stops before the first token.
    hi = [{"role": "user", "content": "hi"}]
    for stop in ("", ["\n", ""]):
        with pytest.raises(UnsupportedParameterError, match=r"stop=.*empty stop string"):
            llm("Count: 1, 2,", max_tokens=2, stop=stop)
        with pytest.raises(UnsupportedParameterError, match=r"stop=.*empty stop string"):
            llm.create_chat_completion(hi, max_tokens=2, stop=stop)


def test_chat_formats_without_an_equivalent_are_refused_when_the_llama_is_made(
    tiny_model_path: Path,
) -> None:
    # They were accepted, and the first chat failed.
    path = str(tiny_model_path)
    for name in ("baichuan", "functionary-v2", "chatml-function-calling"):
        with pytest.raises(UnsupportedParameterError, match=rf"chat_format='{name}'.*chatml"):
            Llama(path, n_ctx=64, verbose=False, chat_format=name)
    with pytest.raises(InvalidParameterError, match=r"no chat format 'nope'.*llama-2"):
        Llama(path, n_ctx=64, verbose=False, chat_format="nope")
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    for name in ("llama-2", "qwen", "mistral-instruct", "chat_template.default", template):
        with Llama(path, n_ctx=64, verbose=False, chat_format=name) as tiny:
            assert tiny.chat_format == name


def test_llama_grammar_offers_ready_grammars_and_the_schema_converter(llm: Llama) -> None:
    # llama_cpp.llama_grammar's JSON_GBNF, json_schema_to_gbnf, ... were missing, and
    # LlamaGrammar(_grammar=..., verbose=False) raised TypeError.
    from llamacrab.compat.llama_grammar import (
        JSON_ARR_GBNF,
        JSON_GBNF,
        LIST_GBNF,
        json_schema_to_gbnf,
    )

    for grammar, start in ((JSON_GBNF, "{"), (JSON_ARR_GBNF, "["), (LIST_GBNF, "- ")):
        constrained = LlamaGrammar(_grammar=grammar, verbose=False)
        result: Any = llm("Here is the data:\n", max_tokens=6, temperature=0, grammar=constrained)
        assert result["choices"][0]["text"].startswith(start)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    text = json.dumps(schema)
    assert json_schema_to_gbnf(text) == LlamaGrammar.from_json_schema(text).grammar
    assert json_schema_to_gbnf(schema) == json_schema_to_gbnf(text)
    with pytest.raises(UnsupportedParameterError, match="prop_order"):
        json_schema_to_gbnf(text, prop_order=["n"])


def test_a_vocab_only_llama_tokenizes_as_the_full_one_and_refuses_to_run(
    llm: Llama, gemma_path: Path
) -> None:
    # llama-cpp-python's tokenizer-only Llama, which code that counts tokens makes.
    text = "Hello world <start_of_turn>user é🙂"
    with Llama(model_path=str(gemma_path), vocab_only=True, verbose=False) as vocab:
        assert vocab.chat_format == "llama-2"  # as llama-cpp-python's: the GGUF has no template
        for special in (False, True):
            assert vocab.tokenize(text.encode(), special=special) == llm.tokenize(
                text.encode(), special=special
            )
        tokens = llm.tokenize(text.encode(), special=True)
        assert vocab.detokenize(tokens, special=True) == llm.detokenize(tokens, special=True)
        assert vocab.tokenizer().encode(text) == llm.tokenizer().encode(text)
        facts = [Llama.n_vocab, Llama.token_bos, Llama.token_eos, Llama.token_nl]
        assert [fact(vocab) for fact in facts] == [fact(llm) for fact in facts]
        assert vocab.metadata == llm.metadata
        assert llm.token_nl() == 248  # llama.cpp's <0x0A>, as llama-cpp-python's: not "\n"'s 107
        # As llama-cpp-python's: its asked context (512 by default), holding no tokens.
        assert (vocab.n_ctx(), vocab.n_tokens, vocab.input_ids.shape) == (512, 0, (512,))
        assert vocab.context_params.n_batch == 512
        for run in (
            lambda: vocab.create_completion("Hello", max_tokens=1),
            lambda: vocab.create_chat_completion([QUESTION], max_tokens=1),
            lambda: vocab.eval(tokens),
            vocab.save_state,
        ):
            with pytest.raises(ContextError, match="made with vocab_only=True"):
                run()
        vocab.reset()
        assert not hasattr(vocab.llamacrab, "__deepcopy__")  # Python's protocols unharmed
        assert vocab.tokenize(b"Hello") == llm.tokenize(b"Hello")  # still usable
        again = pickle.loads(pickle.dumps(vocab))  # made again, vocab_only as well
        with again:
            assert again.tokenize(b"Hello") == llm.tokenize(b"Hello")
            with pytest.raises(ContextError):
                again.create_completion("Hello", max_tokens=1)
    with pytest.raises(UnsupportedParameterError, match="lora_path with vocab_only"):
        Llama(model_path=str(gemma_path), vocab_only=True, lora_path="adapter.gguf")
    # Its settings are checked as a full Llama's would be, though no context is made.
    with pytest.raises(InvalidParameterError, match="type_k must be one of"):
        Llama(model_path=str(gemma_path), vocab_only=True, type_k="f12")
    with pytest.raises(InvalidParameterError, match="n_threads must be"):
        Llama(model_path=str(gemma_path), vocab_only=True, n_threads=-3)


def test_a_model_without_a_chat_template_chats_in_llama_2_s_format(
    tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # llama-cpp-python's default where the GGUF has no template; it raised TemplateError.
    messages = [{"role": "user", "content": "hi"}]
    with Llama(model_path=str(tiny_model_path), n_ctx=128, verbose=False) as llm:
        assert llm.chat_format == "llama-2"
        assert "tiny-llama.gguf has no chat template" in caplog.text
        default = llm.create_chat_completion(messages, max_tokens=2, temperature=0)
    with Llama(str(tiny_model_path), n_ctx=128, verbose=False, chat_format="llama-2") as llm:
        asked = llm.create_chat_completion(messages, max_tokens=2, temperature=0)
    assert default["usage"] == asked["usage"]
    assert default["choices"][0]["message"] == asked["choices"][0]["message"]
