"""llamacrab.compat: llama-cpp-python's Llama API (dicts, streams, hooks, state, keywords) on
llamacrab's engine, with Gemma 3 270M and all-MiniLM-L6-v2."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hub_server import HubServer, Repo

import llamacrab
from llamacrab import InvalidParameterError, StateError
from llamacrab.compat import (
    Llama,
    LlamaDiskCache,
    LlamaGrammar,
    LlamaPromptLookupDecoding,
    LlamaRAMCache,
    LlamaState,
    LogitsProcessorList,
    MinTokensLogitsProcessor,
    StoppingCriteriaList,
    UnsupportedParameterError,
)

from support import load_repo_module

pytestmark = pytest.mark.real_model

REPO = Path(__file__).resolve().parent.parent
REFERENCE = np.load(REPO / "tests" / "fixtures" / "minilm_reference.npz")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
        },
    },
}
# A compact chat template that shows the tools to the model (short prompts, few tokens).
TOOLS_TEMPLATE = (
    "{% for t in tools or [] %}Tool: {{ t.function.name }}"
    "({{ t.function.parameters | tojson }})\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)
COMPLETION_KEYS = {"id", "object", "created", "model", "choices", "usage"}


@pytest.fixture(scope="module")
def llm(gemma_path: Path) -> Iterator[Llama]:
    with Llama(model_path=str(gemma_path), n_ctx=1024, n_threads=2, verbose=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Llama]:
    path = load_repo_module("scripts/convert_bert.py").minilm()
    with Llama(model_path=str(path), embedding=True, n_threads=2, verbose=False) as llm:
        yield llm


def text(result: Any) -> str:
    return str(result["choices"][0]["text"])


# -- completions ------------------------------------------------------------------------------


def test_completion_is_llama_cpp_pythons_dict_from_llamacrabs_engine(llm: Llama) -> None:
    result = llm.create_completion("Paris is the capital of", max_tokens=8, temperature=0)
    assert set(result) == COMPLETION_KEYS
    assert result["object"] == "text_completion" and result["id"].startswith("cmpl-")
    assert result["model"] == llm.model_path
    choice = result["choices"][0]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"}
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["finish_reason"] == "length"
    usage = result["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["prompt_tokens"] == len(llm.tokenize(b"Paris is the capital of"))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # The same engine: llamacrab's own greedy completion, token for token.
    native = llm.llamacrab.create_completion("Paris is the capital of", max_tokens=8, temperature=0)
    assert choice["text"] == native.text and " France" in choice["text"]
    assert llm("Paris is the capital of", max_tokens=8, temperature=0)["choices"] == [choice]


def test_streaming_yields_chunks_then_an_empty_one_with_the_finish_reason(llm: Llama) -> None:
    prompt = "The capital of Germany is the city of"
    whole = text(llm(prompt, max_tokens=24, temperature=0, stop=["second"]))
    chunks = list(llm(prompt, max_tokens=24, temperature=0, stop=["second"], stream=True))
    assert len(chunks) > 2 and all(set(c) == COMPLETION_KEYS - {"usage"} for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    *pieces, last = chunks
    assert last["choices"][0] == {"text": "", "index": 0, "logprobs": None, "finish_reason": "stop"}
    assert all(p["choices"][0]["finish_reason"] is None and p["choices"][0]["text"] for p in pieces)
    assert "".join(text(p) for p in pieces) == whole and whole.endswith(" the ")


def test_echo_logprobs_and_token_prompts(llm: Llama) -> None:
    prompt = "One, two, three,"
    echoed = text(llm(prompt, max_tokens=4, temperature=0, echo=True))
    plain = text(llm(prompt, max_tokens=4, temperature=0))
    assert echoed == prompt + plain
    tokens = llm.tokenize(prompt.encode())
    assert text(llm.create_completion(tokens, max_tokens=4, temperature=0)) == plain
    result = llm(prompt, max_tokens=4, temperature=0, logprobs=2)
    logprobs = result["choices"][0]["logprobs"]
    assert logprobs is not None and len(logprobs["tokens"]) == 4
    assert "".join(logprobs["tokens"]) == text(result)
    assert logprobs["text_offset"][0] == len(prompt)
    for token, value, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert top is not None and top[token] == value and value is not None and value <= 0


def test_echo_with_logprobs_rates_the_prompt_tokens_too(llm: Llama) -> None:
    prompt = "The capital of France is Paris. The capital of Italy is"
    visible = llm.tokenize(prompt.encode())[1:]  # as llama-cpp-python lists them: no BOS
    llm(prompt, max_tokens=1)  # the prompt is in memory now: it must be decoded again anyway
    result = llm(prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = result["choices"][0]
    logprobs = choice["logprobs"]
    assert logprobs is not None and choice["text"].startswith(prompt)
    n = len(visible)
    assert len(logprobs["tokens"]) == n + 3
    assert "".join(logprobs["tokens"]) == choice["text"]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets[n] == len(prompt) and offsets == sorted(offsets)
    # OpenAI's and llama-cpp-python's convention: nothing for the first token.
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    # " Paris" after "The capital of France is": what the engine read from that prompt row is
    # what the prefix alone predicts, not what one token less or more does. Up to the
    # arithmetic of another batch shape: 0.17 apart on an AVX-512 machine, where the rows
    # one token off predict it 6 nats apart.
    paris = logprobs["tokens"].index(" Paris")
    tokens = [llm.token_bos(), *visible]
    predicted = {}
    for prefix in (paris, paris + 1, paris + 2):
        llm.reset()
        llm.llamacrab.create_completion(tokens[:prefix], max_tokens=0)
        logprob = Llama.logits_to_logprobs(llm.llamacrab.context.logits())[tokens[paris + 1]]
        predicted[prefix] = float(logprob)
    value = logprobs["token_logprobs"][paris]
    assert value is not None
    assert min(predicted, key=lambda prefix: abs(predicted[prefix] - value)) == paris + 1
    assert abs(value - predicted[paris + 1]) < 0.5, predicted
    for value, top in zip(
        logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True
    ):
        assert value is not None and value <= 0 and top is not None and len(top) in (2, 3)
    streamed = list(llm(prompt, max_tokens=3, temperature=0, echo=True, logprobs=2, stream=True))
    first = streamed[0]["choices"][0]
    assert first["text"] == prompt and first["logprobs"] is not None
    assert first["logprobs"]["tokens"] == logprobs["tokens"][:n]
    with pytest.raises(UnsupportedParameterError, match="suffix"):
        llm(prompt, suffix="!", echo=True, logprobs=1)


def test_sampling_follows_the_llamas_seed_reproducibly(llm: Llama) -> None:
    def sample() -> str:
        return text(llm("Once upon a time", max_tokens=8, temperature=1.0))

    llm.set_seed(1234)
    first, second = sample(), sample()
    llm.set_seed(1234)
    assert [sample(), sample()] == [first, second]  # each call draws the next seed
    assert text(llm("Once upon a time", max_tokens=8, seed=7)) == text(
        llm("Once upon a time", max_tokens=8, seed=7)
    )


def test_unlimited_max_tokens_and_refused_sampling_keywords(llm: Llama) -> None:
    assert llm("Hello", max_tokens=0, temperature=0, stop=["\n"])["choices"][0]["finish_reason"]
    with pytest.raises(UnsupportedParameterError, match="tfs_z"):
        llm("Hello", tfs_z=0.9)


# -- tokens -----------------------------------------------------------------------------------


def test_tokenize_and_detokenize_work_on_bytes(llm: Llama) -> None:
    data = "Crabs — 蟹 🦀 walk sideways.".encode()
    tokens = llm.tokenize(data)
    assert tokens[0] == llm.token_bos() and all(isinstance(t, int) for t in tokens)
    assert llm.detokenize(tokens) == data
    assert llm.tokenize(data, add_bos=False) == tokens[1:]
    # A token may hold part of a character: bytes, not text, come back.
    pieces = [llm.detokenize([t]) for t in tokens[1:]]
    assert b"".join(pieces) == data
    turn = b"<start_of_turn>user"
    assert len(llm.tokenize(turn, add_bos=False, special=True)) == 2
    assert len(llm.tokenize(turn, add_bos=False)) > 2
    assert llm.detokenize(llm.tokenize(turn, special=True), special=True) == b"<bos>" + turn
    assert llm.n_vocab() == llm.llamacrab.vocab.n_tokens and llm.n_ctx() == 1024
    assert llm.tokenizer().decode(llm.tokenizer().encode("sideways")) == "sideways"


def test_a_dropped_llama_and_its_tokenizer_free_the_model_at_once(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llamacrab._native import handle

    frees: list[str] = []
    monkeypatch.setattr(handle, "free_observer", lambda kind, at: frees.append(kind))
    llm = Llama(tiny_model_path, n_ctx=64, verbose=False)
    tokenizer = llm.tokenizer_
    assert tokenizer.decode(tokenizer.encode("sideways")) == "sideways"
    gc.collect()
    gc.disable()  # (Llama.tokenizer_ held its Llama: a cycle, freed by the collector only)
    try:
        del llm
        assert "model" not in frees and tokenizer.encode("walk")  # the tokenizer keeps it
        del tokenizer
        assert "model" in frees
    finally:
        gc.enable()


# -- grammars, logits processors, stopping criteria -------------------------------------------


def test_grammar_constrains_the_completion(llm: Llama, tmp_path: Path) -> None:
    yes_no = LlamaGrammar.from_string('root ::= "yes" | "no"')
    assert text(llm("Is the sky blue? Answer:", grammar=yes_no, max_tokens=4)) in ("yes", "no")
    file = tmp_path / "digits.gbnf"
    file.write_text("root ::= [0-9]+\n")
    assert text(llm("Pick a number:", grammar=LlamaGrammar.from_file(file), max_tokens=3)).isdigit()
    schema = {"type": "object", "properties": {"legs": {"type": "integer", "maximum": 99}},
              "required": ["legs"]}  # fmt: skip
    crab = LlamaGrammar.from_json_schema(json.dumps(schema))
    value = json.loads(text(llm("A crab as JSON:", grammar=crab, max_tokens=24, temperature=0)))
    assert set(value) == {"legs"} and isinstance(value["legs"], int)
    with pytest.raises(llamacrab.GrammarError, match="maxLenght"):  # a typo is no keyword
        LlamaGrammar.from_json_schema('{"type": "string", "maxLenght": 3}')


def test_logits_processors_see_the_ids_and_change_the_scores(llm: Llama) -> None:
    prompt = "I like to eat"
    banana = llm.tokenize(b" banana", add_bos=False)[0]
    seen: list[np.ndarray] = []

    def favour_banana(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        seen.append(input_ids.copy())
        assert scores.shape == (llm.n_vocab(),) and scores.dtype == np.float32
        scores[banana] += 100.0
        return scores

    processors = LogitsProcessorList([favour_banana])
    result = llm(prompt, logits_processor=processors, max_tokens=3, temperature=0)
    assert text(result) == " banana banana banana"
    prompt_ids = llm.tokenize(prompt.encode())
    assert seen[0].tolist() == prompt_ids
    assert seen[2].tolist() == [*prompt_ids, banana, banana]
    # llama-cpp-python's min-tokens processor, and a processor's error reaches the caller.
    eos = MinTokensLogitsProcessor(6, llm.token_eos())
    usage = llm("Hi", logits_processor=LogitsProcessorList([eos]), max_tokens=6)["usage"]
    assert usage["completion_tokens"] == 6

    def broken(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        raise RuntimeError("processor failed")

    with pytest.raises(RuntimeError, match="processor failed"):
        llm(prompt, logits_processor=LogitsProcessorList([broken]), max_tokens=3)
    assert text(llm(prompt, max_tokens=3, temperature=0)) != " banana banana banana"


def test_a_hooks_exception_reaches_the_caller_and_the_llama_stays_usable(llm: Llama) -> None:
    prompt = "I like to eat"
    expected = text(llm(prompt, max_tokens=4, temperature=0))
    calls = 0

    def fails_third(input_ids: np.ndarray, logits: np.ndarray) -> bool:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyError("criterion failed")
        return False

    criteria = StoppingCriteriaList([fails_third])
    with pytest.raises(KeyError, match="criterion failed"):
        llm(prompt, stopping_criteria=criteria, max_tokens=8, temperature=0)
    assert calls == 3  # raised at once: the generation did not go on
    calls = 0
    chunks = llm(prompt, stopping_criteria=criteria, max_tokens=8, temperature=0, stream=True)
    with pytest.raises(KeyError, match="criterion failed"):
        list(chunks)
    calls = 0
    with pytest.raises(KeyError, match="criterion failed"):
        list(llm.generate(llm.tokenize(prompt.encode()), stopping_criteria=criteria))

    def broken(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        raise RuntimeError("chat processor failed")

    messages = [{"role": "user", "content": "Hi"}]
    processors = LogitsProcessorList([broken])
    with pytest.raises(RuntimeError, match="chat processor failed"):
        llm.create_chat_completion(messages, logits_processor=processors, max_tokens=4)
    assert text(llm(prompt, max_tokens=4, temperature=0)) == expected


def test_stopping_criteria_end_before_the_token_they_see(llm: Llama) -> None:
    prompt = "Count: one, two, three,"
    n_prompt = len(llm.tokenize(prompt.encode()))
    calls: list[int] = []

    def after_five(input_ids: np.ndarray, logits: np.ndarray) -> bool:
        calls.append(len(input_ids))
        assert logits.shape == (llm.n_vocab(),)
        return len(input_ids) >= n_prompt + 5

    criteria = StoppingCriteriaList([after_five])
    result = llm(prompt, stopping_criteria=criteria, max_tokens=20, temperature=0)
    assert result["choices"][0]["finish_reason"] == "stop"
    assert result["usage"]["completion_tokens"] == 5
    assert calls == list(range(n_prompt, n_prompt + 6))
    greedy = llm.llamacrab.create_completion(prompt, max_tokens=5, temperature=0)
    assert text(result) == greedy.text
    streamed = list(llm(prompt, stopping_criteria=criteria, max_tokens=20, temperature=0,
                        stream=True))  # fmt: skip
    assert "".join(text(c) for c in streamed) == greedy.text
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"
    # Where a grammar forbids ending, a criterion still ends the generation at that token.
    digits = LlamaGrammar.from_string('root ::= [0-9]+ "."')
    start = len(llm.tokenize(b"Pi is 3."))

    def after_three(input_ids: np.ndarray, logits: np.ndarray) -> bool:
        return len(input_ids) >= start + 3

    result = llm("Pi is 3.", stopping_criteria=StoppingCriteriaList([after_three]),
                 grammar=digits, max_tokens=20, temperature=0)  # fmt: skip
    assert result["usage"]["completion_tokens"] == 3
    assert result["choices"][0]["finish_reason"] == "stop" and text(result).isdigit()


# -- chat -------------------------------------------------------------------------------------


def test_chat_completion_dict_and_stream(llm: Llama) -> None:
    messages = [{"role": "user", "content": "Name a sea animal."}]
    result = llm.create_chat_completion(messages, max_tokens=12, temperature=0)
    assert set(result) == COMPLETION_KEYS and result["object"] == "chat.completion"
    assert result["id"].startswith("chatcmpl-")
    choice = result["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length") and choice["logprobs"] is None
    native = llm.llamacrab.create_chat_completion(messages, max_tokens=12, temperature=0)
    assert choice["message"]["content"] == native.text
    chunks = list(llm.create_chat_completion(messages, max_tokens=12, temperature=0, stream=True))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert "".join(d["content"] for d in deltas) == native.text
    typed = llm.create_chat_completion_openai_v1(messages, max_tokens=2, temperature=0)
    assert type(typed).__module__.startswith("openai.") and typed.choices[0].message.content
    with_logprobs = llm.create_chat_completion(
        messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = with_logprobs["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and len(content[0]["top_logprobs"]) >= 2


def test_chat_json_response_format(llm: Llama) -> None:
    schema = {"type": "object", "properties": {"animal": {"type": "string", "maxLength": 20}},
              "required": ["animal"]}  # fmt: skip
    result = llm.create_chat_completion(
        [{"role": "user", "content": "Name a sea animal as JSON."}],
        response_format={"type": "json_object", "schema": schema},
        max_tokens=32,
        temperature=0,
    )
    assert set(json.loads(result["choices"][0]["message"]["content"])) == {"animal"}


def test_forced_tool_calls_come_back_as_tool_calls(llm: Llama) -> None:
    before, llm.chat_format = llm.chat_format, TOOLS_TEMPLATE  # read at each call, as there
    try:
        messages = [{"role": "user", "content": "What is the weather in Lisbon?"}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        result = llm.create_chat_completion(
            messages, tools=[WEATHER], tool_choice=named, max_tokens=48, temperature=0
        )
        choice = result["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] is None
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["id"]
        assert call["function"]["name"] == "get_weather"
        assert set(json.loads(call["function"]["arguments"])) == {"city"}
        assert message["function_call"] == call["function"]
        # The legacy functions= / function_call= form, and a bare tool name as tool_choice.
        legacy = llm.create_chat_completion(
            messages, functions=[WEATHER["function"]], function_call={"name": "get_weather"},
            max_tokens=48, temperature=0,
        )  # fmt: skip
        assert legacy["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == (
            "get_weather"
        )
        stream = list(llm.create_chat_completion(messages, tools=[WEATHER],
                                                 tool_choice="get_weather", max_tokens=48,
                                                 temperature=0, stream=True))  # fmt: skip
        calls = [d for c in stream if (d := c["choices"][0]["delta"]).get("tool_calls")]
        assert calls[0]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert calls[0]["tool_calls"][0]["index"] == 0
        assert stream[-1]["choices"][0]["finish_reason"] == "tool_calls"
    finally:
        llm.chat_format = before


def test_chat_logits_processor_gets_the_chat_prompt(llm: Llama) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    seen: list[list[int]] = []

    def spy(input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        seen.append(input_ids.tolist())
        return scores

    llm.create_chat_completion(messages, logits_processor=LogitsProcessorList([spy]),
                               max_tokens=2, temperature=0)  # fmt: skip
    prompt = llm.llamacrab.chat_prompt(messages)
    assert seen[0] == llm.llamacrab.tokenize(prompt, add_special=True, parse_special=True)


# -- state, threads, speculation, loading -----------------------------------------------------


def test_save_and_load_state_restore_memory_and_seed(llm: Llama, tiny_model_path: Path) -> None:
    prompt = "Pick a number from 1 to 100:"
    llm.set_seed(99)
    llm(prompt, max_tokens=1)
    state = llm.save_state()
    assert state.n_tokens == len(state.input_ids) > 0
    first = text(llm(prompt, max_tokens=12, temperature=1.0))
    second = text(llm(prompt, max_tokens=12, temperature=1.0))
    llm.load_state(state)
    assert text(llm(prompt, max_tokens=12, temperature=1.0)) == first
    assert first != second
    llm.reset()
    other = Llama(model_path=str(tiny_model_path), n_ctx=128, verbose=False)
    with other, pytest.raises(StateError, match="different model"):
        other.load_state(state)


@pytest.mark.parametrize("state", [object(), None, "a state"])
def test_load_state_of_something_else_names_what_it_takes(llm: Llama, state: object) -> None:
    with pytest.raises(InvalidParameterError, match="takes a LlamaState from save_state"):
        llm.load_state(state)  # type: ignore[arg-type]
    assert llm("Hello", max_tokens=1)["choices"]  # the Llama is still usable


def test_load_state_without_a_seed_changes_nothing(llm: Llama) -> None:
    llm("Hello there", max_tokens=1)
    state = llm.save_state()
    seedless = LlamaState(state.input_ids, state.scores, state.n_tokens, state.llama_state,
                          state.llama_state_size, seed=None)  # type: ignore[arg-type]  # fmt: skip
    llm.reset()
    with pytest.raises(InvalidParameterError, match="seed is an int, not None"):
        llm.load_state(seedless)
    assert llm.n_tokens == 0  # the memory was not restored before the refusal


def test_set_cache_keeps_prompt_states_in_llamacrabs_caches(llm: Llama, tmp_path: Path) -> None:
    prompt = "A prompt worth caching: the planets of the solar system, in order, are"
    assert llm.cache is None
    ram = LlamaRAMCache(capacity_bytes=1 << 30)
    llm.set_cache(ram)
    try:
        assert llm.cache is ram and llm.llamacrab.cache is ram
        first = text(llm(prompt, max_tokens=2, temperature=0))
        assert len(ram) == 1 and ram.cache_size > 0
        llm.reset()  # the KV memory is empty: only the cache holds the prompt now
        again = llm.llamacrab.create_completion(prompt, max_tokens=2, temperature=0)
        assert again.usage.cached_tokens > 0 and again.text == first
        disk = LlamaDiskCache(cache_dir=str(tmp_path / "cache"))
        llm.cache = disk
        llm.reset()
        llm(prompt, max_tokens=2, temperature=0)
        assert len(disk) == 1 and disk.cache_size > 0 and disk.cache_dir.endswith("cache")
        with pytest.raises(UnsupportedParameterError, match=r"set_cache\(dict\)"):
            llm.set_cache({})  # type: ignore[arg-type]
        assert llm.cache is disk
    finally:
        llm.set_cache(None)
    assert llm.cache is None and llm.llamacrab.cache is None


def test_streams_from_two_threads_take_turns(llm: Llama) -> None:
    expected = text(llm("Paris is the capital of", max_tokens=10, temperature=0))
    results: list[str] = []

    def stream() -> None:
        chunks = llm("Paris is the capital of", max_tokens=10, temperature=0, stream=True)
        parts = [(text(c), c["choices"][0]["finish_reason"]) for c in chunks]
        results.append("".join(t for t, _ in parts) + "|" + str(parts[-1][1]))

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [expected + "|length"] * 3


def test_a_stream_left_by_an_ended_thread_holds_no_turn(tiny_model_path: Path) -> None:
    # The turn was keyed on the ended thread's id: every other thread's call waited for ever
    # (and a thread reusing the id passed; found by a hostile-input hunt).
    with Llama(model_path=str(tiny_model_path), n_ctx=128, n_threads=1, verbose=False) as tiny:
        kept: list[Any] = []

        def read_one() -> None:
            chunks = tiny("the cat", max_tokens=30, stream=True)
            next(chunks)
            kept.append(chunks)

        answers: list[str] = []
        go = threading.Event()

        def call() -> None:
            go.wait()
            answers.append(text(tiny("hi", max_tokens=2)))

        # Started first, so that it cannot get the ended thread's id (which passed as the owner).
        caller = threading.Thread(target=call)
        caller.start()
        worker = threading.Thread(target=read_one)
        worker.start()
        worker.join()
        go.set()
        caller.join(timeout=60)
        assert not caller.is_alive() and len(answers) == 1
        # The stream left behind was superseded; read on, it ends without taking a turn back.
        assert [c["choices"][0]["finish_reason"] for c in kept[0]][-1] is not None
        assert text(tiny("hi", max_tokens=2, temperature=0)) == text(
            tiny("hi", max_tokens=2, temperature=0)
        )


def test_prompt_lookup_draft_model_and_generate(llm: Llama, gemma_path: Path) -> None:
    prompt = "a b c d e f g h a b c d e f g h a b c d"
    with Llama(model_path=str(gemma_path), n_ctx=512, n_threads=2, verbose=False,
               draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4)) as drafted:  # fmt: skip
        fast = text(drafted(prompt, max_tokens=12, temperature=0))
        assert drafted.llamacrab.speculative_stats.drafted > 0
    assert fast == text(llm(prompt, max_tokens=12, temperature=0))
    tokens = []
    for token in llm.generate(llm.tokenize(b"Paris is the capital of"), temp=0):
        tokens.append(token)
        if len(tokens) == 6:
            break
    assert llm.detokenize(tokens) == text(llm("Paris is the capital of", max_tokens=6,
                                              temperature=0)).encode()  # fmt: skip


def test_constructor_keywords_map_refuse_or_fail_by_name(
    gemma_path: Path, tiny_model_path: Path
) -> None:
    path = str(gemma_path)
    with pytest.raises(TypeError, match="'no_such_option'"):
        Llama(model_path=path, no_such_option=1)
    with pytest.raises(UnsupportedParameterError) as refused:
        Llama(model_path=path, yarn_beta_fast=8.0, numa=4, chat_handler=object(), n_parts=2)
    assert [r.split("=")[0].split(" ")[0] for r in refused.value.reasons] == [
        "n_parts", "yarn_beta_fast", "numa", "chat_handler"
    ]  # fmt: skip
    assert isinstance(refused.value, NotImplementedError | ValueError)
    with pytest.raises(ValueError, match="does not exist"):
        Llama(model_path="no/such/model.gguf")
    # What LangChain passes: legacy keywords llama-cpp-python ignores are accepted.
    with Llama(tiny_model_path, n_ctx=64, n_batch=8, n_parts=-1, seed=-1, f16_kv=True,
               logits_all=False, vocab_only=False, use_mlock=False, n_threads=None,
               use_mmap=True, last_n_tokens_size=32, rope_freq_base=10000.0,
               rope_freq_scale=1.0, lora_base=None, lora_path=None, device=None, verbose=True,
               type_k=llamacrab.compat.GGML_TYPE_F32, flash_attn=True) as llm:  # fmt: skip
        params = llm.llamacrab.context.params
        assert (params.n_ctx, params.n_batch, params.n_ubatch) == (64, 8, 8)
        assert (params.rope_freq_base, params.type_k, params.flash_attn) == (10000.0, "f32", "on")
        assert llm.context_params.n_ctx == llm.n_ctx() == llm.llamacrab.context.n_ctx
    with Llama(tiny_model_path, n_ctx=0, verbose=False) as llm:  # 0: the model's own context
        assert llm.n_ctx() == llm.llamacrab.model.n_ctx_train


def test_lora_path_and_scale(tiny_model_path: Path, tmp_path: Path) -> None:
    adapter = load_repo_module("scripts/make_tiny_gguf.py").write_tiny_lora(tmp_path / "l.gguf")
    with Llama(tiny_model_path, n_ctx=64, lora_path=str(adapter), lora_scale=0.5) as llm:
        assert list(llm.llamacrab.context.lora_adapters.values()) == [0.5]


def test_from_pretrained_uses_the_hub_cache(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {"tiny-Q4_K_M.gguf": tiny_model_path.read_bytes()}
    hub = HubServer({"crab/tiny": Repo({"main": files})})
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with Llama.from_pretrained("crab/tiny", "*Q4_K_M.gguf", cache_dir=tmp_path, n_ctx=64,
                                   verbose=False) as llm:  # fmt: skip
            assert Path(llm.model_path).name == "tiny-Q4_K_M.gguf"
            assert llm("the cat", max_tokens=2, temperature=0)["usage"]["completion_tokens"] == 2
        with pytest.raises(UnsupportedParameterError, match="local_dir"):
            Llama.from_pretrained("crab/tiny", "*.gguf", local_dir=tmp_path)
    finally:
        hub.close()


# -- embeddings -------------------------------------------------------------------------------


def test_create_embedding_and_embed_with_minilm(minilm: Llama) -> None:
    sentences = [str(s) for s in REFERENCE["sentences"]]
    response = minilm.create_embedding(sentences)
    assert response["object"] == "list" and response["model"] == minilm.model_path
    assert [d["index"] for d in response["data"]] == list(range(len(sentences)))
    assert all(d["object"] == "embedding" for d in response["data"])
    vectors = np.array([d["embedding"] for d in response["data"]], dtype=np.float32)
    assert vectors.shape == (len(sentences), 384)
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)  # not normalized, as there
    assert np.sum(unit * REFERENCE["vectors"], axis=1).min() >= 0.999
    tokens = sum(len(minilm.tokenize(s.encode())) for s in sentences)
    assert response["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    one = minilm.embed(sentences[0])
    assert isinstance(one, list) and isinstance(one[0], float)
    assert np.dot(one, unit[0]) / np.linalg.norm(one) > 0.9999  # alone, or packed with others
    normalized, count = minilm.embed(sentences[:2], normalize=True, return_count=True)
    assert np.allclose(np.linalg.norm(normalized, axis=1), 1.0, atol=1e-5) and count > 0


def test_embeddings_need_embedding_true(llm: Llama) -> None:
    with pytest.raises(ValueError, match="embedding=True"):
        llm.create_embedding("hello")


# -- the llama_cpp alias ----------------------------------------------------------------------

SHIM_CHECK = """
import sys
import llamacrab.compat as compat
{setup}
import llama_cpp
from llama_cpp import Llama, LlamaGrammar, LogitsProcessorList, StoppingCriteriaList
from llama_cpp.llama import LlamaState
from llama_cpp.llama_types import CreateCompletionResponse, ChatCompletionRequestMessage
from llama_cpp.llama_grammar import LlamaGrammar as Grammar2
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
from llama_cpp.llama_cache import LlamaRAMCache, LlamaDiskCache
from llama_cpp.llama_chat_format import Llava15ChatHandler, MTMDChatHandler
assert Llava15ChatHandler.__module__ == "llamacrab.compat.llama_chat_format"
assert llama_cpp.LlamaRAMCache is LlamaRAMCache and llama_cpp.LlamaCache is LlamaRAMCache
assert llama_cpp is compat and Llama is compat.Llama and Grammar2 is LlamaGrammar
print("version", llama_cpp.__version__, compat.installed())
compat.uninstall()
print("after", "llama_cpp" in sys.modules, compat.installed())
"""


def run_python(code: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args, "-c", code] if not args else
                          [sys.executable, *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)  # fmt: skip


def test_nothing_is_aliased_by_default(tmp_path: Path) -> None:
    code = "import llamacrab, llamacrab.compat, sys; print('llama_cpp' in sys.modules)"
    assert run_python(code, tmp_path).stdout.strip() == "False"


def test_install_aliases_llama_cpp_and_its_submodules(tmp_path: Path) -> None:
    result = run_python(SHIM_CHECK.format(setup="compat.install()"), tmp_path)
    assert result.returncode == 0, result.stderr
    assert "version 0.3.36+llamacrab" in result.stdout and "after False False" in result.stdout


def test_a_real_llama_cpp_is_not_shadowed_unless_forced(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    setup = "sys.path.insert(0, 'site')\n{}"
    refused = run_python(SHIM_CHECK.format(setup=setup.format("compat.install()")), tmp_path)
    assert refused.returncode != 0 and "real llama_cpp" in refused.stderr
    forced = run_python(SHIM_CHECK.format(setup=setup.format("compat.install(force=True)")),
                        tmp_path)  # fmt: skip
    assert forced.returncode == 0, forced.stderr


def test_module_runner_runs_an_unchanged_llama_cpp_script(tmp_path: Path, gemma_path: Path) -> None:
    script = tmp_path / "legacy.py"
    script.write_text(
        "import sys\nfrom llama_cpp import Llama\n"
        "llm = Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)\n"
        "out = llm('Paris is the capital of', max_tokens=4, temperature=0)\n"
        "print(out['choices'][0]['text'])\n"
    )
    result = run_python("", tmp_path, "-m", "llamacrab.compat", str(script), str(gemma_path))
    assert result.returncode == 0, result.stderr
    assert "France" in result.stdout


def test_example_runs(tmp_path: Path) -> None:
    command = [sys.executable, str(REPO / "examples" / "compat_llama_cpp.py")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "completion: ' France" in result.stdout and "| length" in result.stdout
    assert "engine: llamacrab._llama" in result.stdout
    assert "tokens counted: 7" in result.stdout  # vocab_only


def test_values_of_another_type_are_refused_by_keyword(tiny_model_path: Path) -> None:
    # Found by the compat reliability section: values code written for llama-cpp-python passes
    # through unchecked failed deep inside (a TypeError from a comparison, AttributeError,
    # KeyError), instead of a ValueError naming the keyword.
    with pytest.raises(InvalidParameterError, match="chat_format must be"):
        Llama(tiny_model_path, n_ctx=64, verbose=False, chat_format=5)  # type: ignore[arg-type]
    with Llama(tiny_model_path, n_ctx=128, verbose=False, chat_format="chatml") as llm:
        hi = [{"role": "user", "content": "hi"}]
        refused: list[tuple[str, dict[str, Any]]] = [
            ("temperature must be a number", {"temperature": "1"}),
            ("top_k must be an integer", {"top_k": [1]}),
            ("logit_bias must be a mapping", {"logit_bias": True}),
            ("logit_bias maps token ids to numbers", {"logit_bias": {2: [1]}}),
            ("logit_bias maps token ids to numbers", {"logit_bias": {"two": 1.0}}),
            ("logit_bias maps token ids to numbers", {"logit_bias": {"²": 1.0}}),  # not int()
            ("stop must be", {"stop": 5}),
        ]
        for message, keywords in refused:
            with pytest.raises(InvalidParameterError, match=message):
                llm.create_completion("the cat", max_tokens=2, **keywords)
        chat_refused: list[tuple[str, dict[str, Any]]] = [
            ("logprobs must be", {"logprobs": "yes"}),
            ("functions must be a list", {"functions": True}),
            ("tools must be a list", {"tools": {"a": 1}}),
            ("function_call must be", {"function_call": {"type": "function"}}),
            ("messages must be a list of items each", {"messages": [5]}),
        ]
        for message, keywords in chat_refused:
            with pytest.raises(InvalidParameterError, match=message):
                llm.create_chat_completion(**{"messages": hi, "max_tokens": 2, **keywords})
        # Still usable; token ids as a numpy array and as text keys are what they always were.
        tokens = np.asarray(llm.tokenize(b"the cat"), dtype=np.intc)
        done = llm.create_completion(tokens, max_tokens=2, logit_bias={"5": 1.0}, seed=1)
        assert done["usage"]["prompt_tokens"] == len(tokens)
        with pytest.raises(TypeError, match="unexpected keyword"):  # Python's own, as before
            llm.create_completion("the cat", no_such_keyword=1)  # type: ignore[call-arg]


def test_a_pickled_llama_loads_its_model_again_with_the_same_arguments(
    tiny_model_path: Path,
) -> None:
    # llama-cpp-python pickles a Llama as its arguments (to hand one to a worker process).
    import copy
    import pickle

    with Llama(str(tiny_model_path), n_ctx=256, n_threads=1, seed=7, verbose=False) as original:
        expected = text(original.create_completion("the cat", max_tokens=6, temperature=0))
        for restored in (pickle.loads(pickle.dumps(original)), copy.deepcopy(original)):
            with restored:
                assert restored.llamacrab is not original.llamacrab
                assert restored.n_ctx() == original.n_ctx() == 256
                assert restored.model_path == original.model_path
                assert text(restored.create_completion("the cat", max_tokens=6,
                                                       temperature=0)) == expected  # fmt: skip
        assert not original.llamacrab.closed  # the copies closed their own


def test_an_empty_token_prompt_with_echo_and_logprobs_is_refused(tiny_model_path: Path) -> None:
    with (
        Llama(model_path=str(tiny_model_path), n_ctx=64, n_threads=1, verbose=False) as tiny,
        pytest.raises(InvalidParameterError, match="the prompt is empty"),
    ):
        tiny.create_completion([], echo=True, logprobs=1, max_tokens=1)  # was IndexError


def test_logits_to_logprobs_of_no_logits_says_so() -> None:
    # numpy's "zero-size array to reduction operation maximum which has no identity" was the
    # answer (llama-cpp-python's too); a ValueError still, naming what is missing.
    for logits, axis in (([], -1), (np.zeros((3, 0)), -1), (np.zeros((0, 4)), 0)):
        with pytest.raises(ValueError, match="at least one logit along axis"):
            Llama.logits_to_logprobs(logits, axis=axis)
    assert Llama.logits_to_logprobs(np.zeros((0, 4))).shape == (0, 4)  # no rows: no rows out
    assert np.allclose(Llama.logits_to_logprobs([0.0, 0.0]), np.log([0.5, 0.5]))
