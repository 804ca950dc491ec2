"""Tool calls: parsed from each common format, given to the template, forced by grammar."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest

from llamacrab import (
    ChatChoice,
    CustomSampler,
    InvalidParameterError,
    Llama,
    ToolCall,
    ToolCallError,
    parse_tool_calls,
)
from llamacrab._chat.generic_tools import parse_generic
from llamacrab._chat.tool_calls import ToolCallSplitter, check_arguments

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Lisbon"]}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TEMPLATE = (
    "{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Llama]:
    path = tiny.write_tiny_llama(tmp_path_factory.mktemp("tools") / "tiny-tools.gguf",
                                 chat_templates={"": TEMPLATE})  # fmt: skip
    with Llama(path, n_ctx=256, n_threads=2) as model:
        yield model


@pytest.mark.parametrize(
    "text",
    [
        'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        'Sure. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ],
)
def test_each_format_is_parsed(text: str) -> None:
    content, calls = parse_tool_calls(text)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0].id.startswith("call_") and calls[0].type == "function"


def test_generic_json_and_plain_text() -> None:
    text = '{"tool_calls": [{"name": "a", "arguments": "{}"}, {"name": "b", "arguments": {}}]}'
    assert [c.name for c in parse_tool_calls(text)[1]] == ["a", "b"]
    assert parse_tool_calls('{"name": "a", "arguments": {"x": 1}}')[1][0].arguments == '{"x": 1}'
    assert parse_tool_calls("just an answer") == ("just an answer", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>")[1] == []


def test_tools_reach_the_template(llm: Llama) -> None:
    prompt = llm.chat_prompt([{"role": "user", "content": "hi"}], tools=[WEATHER, TIME])
    assert prompt == "TOOLS get_weather get_time <user>hi<assistant>"  # trim_blocks ate "\n"


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_always_yields_a_valid_call(llm: Llama, seed: int) -> None:
    messages = [{"role": "user", "content": "weather?"}]
    result = llm.create_chat_completion(messages, tools=[WEATHER, TIME], tool_choice="required",
                                        max_tokens=200, temperature=1.0, seed=seed)  # fmt: skip
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.arguments)
    assert call.name in ("get_weather", "get_time")
    if call.name == "get_weather":
        assert arguments["city"] in ("Paris", "Lisbon")


def test_named_tool_choice_and_none(llm: Llama) -> None:
    messages = [{"role": "user", "content": "time?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    result = llm.create_chat_completion(messages, tools=[WEATHER, TIME], tool_choice=named,
                                        max_tokens=120, temperature=0)  # fmt: skip
    assert [c.name for c in result.choices[0].message.tool_calls] == ["get_time"]
    plain = llm.create_chat_completion(messages, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert plain.choices[0].message.tool_calls == ()
    with pytest.raises(InvalidParameterError, match="not among the tools"):
        llm.create_chat_completion(messages, tools=[WEATHER], tool_choice=named)
    with pytest.raises(InvalidParameterError, match="needs tools"):
        llm.create_chat_completion(messages, tool_choice="required")
    with pytest.raises(InvalidParameterError, match="tool 0"):
        llm.create_chat_completion(messages, tools=[{"name": "bare"}])


@pytest.mark.parametrize("seed", range(3))
def test_a_function_without_parameters_is_called_with_none(llm: Llama, seed: int) -> None:
    """OpenAI: omitting parameters defines a function that takes none, so a forced call's
    arguments are ``{}`` (the model invented keys when any object was allowed)."""
    bare = {"type": "function", "function": {"name": "ping"}}
    result = llm.create_chat_completion([{"role": "user", "content": "ping?"}], tools=[bare],
                                        tool_choice="required", max_tokens=200,
                                        temperature=1.0, seed=seed)  # fmt: skip
    assert [json.loads(c.arguments) for c in result.choices[0].message.tool_calls] == [{}]


@pytest.mark.parametrize(
    "parameters", [{"type": "string"}, {"type": ["object", "null"]}, "object", [{"type": "object"}]]
)
def test_parameters_that_are_not_an_object_schema_are_refused(
    llm: Llama, parameters: object
) -> None:
    """Arguments are a JSON object: a call constrained to a string would answer text no
    client reads as arguments (Anthropic's route answered 500 for it)."""
    tool = {"type": "function", "function": {"name": "shout", "parameters": parameters}}
    with pytest.raises(InvalidParameterError, match="'shout': parameters must be a JSON Schema"):
        llm.create_chat_completion([{"role": "user", "content": "hi"}], tools=[tool],
                                   tool_choice="required")  # fmt: skip
    untyped = {"properties": {"word": {"enum": ["hey"]}}, "required": ["word"]}
    tool["function"]["parameters"] = untyped  # no "type": read as an object's schema
    result = llm.create_chat_completion([{"role": "user", "content": "hi"}], tools=[tool],
                                        tool_choice="required", max_tokens=200)  # fmt: skip
    assert json.loads(result.choices[0].message.tool_calls[0].arguments) == {"word": "hey"}


def test_functionary_formats() -> None:
    v31 = 'Ok <function=get_weather>{"city": "Paris"}</function><function=get_time>{}</function>'
    content, calls = parse_tool_calls(v31)
    assert content == "Ok" and [c.name for c in calls] == ["get_weather", "get_time"]
    v3 = '>>>get_weather\n{"city": "Lisbon"}'
    assert [json.loads(c.arguments) for c in parse_tool_calls(v3)[1]] == [{"city": "Lisbon"}]


@pytest.mark.parametrize("seed", range(3))
def test_a_streamed_forced_call_arrives_as_one_tool_call_delta(llm: Llama, seed: int) -> None:
    messages = [{"role": "user", "content": "weather?"}]
    stream = llm.stream_chat_completion(messages, tools=[WEATHER], tool_choice="required",
                                        max_tokens=200, temperature=1.0, seed=seed)  # fmt: skip
    chunks = list(stream)
    assert chunks[0].delta.role == "assistant"
    assert "".join(c.delta.content for c in chunks) == ""  # the call's JSON is not content
    last = chunks[-1]
    assert last.finish_reason == "tool_calls" and len(last.delta.tool_calls) == 1
    assert json.loads(last.delta.tool_calls[0].arguments)["city"] in ("Paris", "Lisbon")


@pytest.mark.parametrize(
    "pieces",
    [
        ["Let me check. <tool", "_call>", '{"name": "get_time", ', '"arguments": {}}</tool_call>'],
        ['{"name": ', '"get_time", "arguments": {}}'],
        ["[TOOL", "_CALLS][", '{"name": "get_time", "arguments": {}}]'],
    ],
)
def test_streamed_text_is_split_at_the_tool_call_opener(pieces: list[str]) -> None:
    splitter = ToolCallSplitter()
    emitted = "".join(splitter.push(p) for p in pieces)
    content, calls = splitter.finish()
    assert (emitted + content).strip() in ("Let me check.", "")
    assert [c.name for c in calls] == ["get_time"]


def test_streamed_text_without_a_call_is_all_content() -> None:
    splitter = ToolCallSplitter()
    pieces = ["The answer ", "is <b>42</b> ", ">> not a call"]
    emitted = "".join(splitter.push(p) for p in pieces)
    rest, calls = splitter.finish()
    assert emitted + rest == "".join(pieces) and calls == []


HERMES_TEMPLATE = (
    "{% if tools %}Call a tool ({{ tools|map(attribute='function.name')|join(', ') }}) as "
    "<tool_call>{...}</tool_call>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
)


class StartText(CustomSampler):
    """Forces the first tokens of the answer (here: a tool-call opener), then lets go."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.done = tokens, 0

    def apply(self, candidates: np.ndarray) -> None:
        if self.done < len(self.tokens):
            wanted = self.tokens[self.done]
            keep = candidates["logit"][wanted]
            candidates["logit"][:] = -np.inf
            candidates["logit"][wanted] = keep

    def accept(self, token: int) -> None:
        self.done += 1


@pytest.mark.parametrize("seed", range(4))
def test_auto_tool_choice_makes_a_started_call_well_formed(llm: Llama, seed: int) -> None:
    messages = [{"role": "user", "content": "weather?"}]
    opener = llm.tokenize("<tool_call>", add_special=False)

    def answer(chat_format: str) -> ChatChoice:
        result = llm.create_chat_completion(
            messages, chat_format=chat_format, tools=[WEATHER], tool_choice="auto",
            check_tool_arguments=True, max_tokens=150, temperature=1.0, seed=seed,
            custom_samplers=(StartText(opener),),
        )  # fmt: skip
        return result.choices[0]

    lazy = answer(HERMES_TEMPLATE)  # the template shows the opener: the lazy grammar applies
    assert lazy.finish_reason == "tool_calls", lazy.message.content
    assert json.loads(lazy.message.tool_calls[0].arguments)["city"] in ("Paris", "Lisbon")
    free = answer(TEMPLATE)  # no opener in the template: random text after "<tool_call>"
    assert free.finish_reason != "tool_calls"


def test_tool_arguments_are_checked_against_their_schema() -> None:
    def call(name: str, arguments: str) -> ToolCall:
        return ToolCall(name, arguments, "call_1")

    check_arguments([call("get_weather", '{"city": "Paris", "days": 2}')], [WEATHER, TIME])
    for bad, words in [
        (call("get_weather", '{"city": "Rome"}'), "'Rome' is not one of"),
        (call("get_weather", '{"days": 2}'), "'city' is a required property"),
        (call("get_weather", "{city: Paris}"), "not JSON"),
        (call("launch", "{}"), "not among the tools"),
    ]:
        with pytest.raises(ToolCallError, match=words):
            check_arguments([bad], [WEATHER, TIME])


def test_trigger_words_with_regex_characters_match_literally(llm: Llama) -> None:
    grammar = 'root ::= "[TOOL_CALLS]" " done"'
    opener = llm.tokenize("[TOOL_CALLS]", add_special=False)
    result = llm.create_completion("x", max_tokens=30, temperature=1.0, seed=1, grammar=grammar,
                                   grammar_trigger_words=("[TOOL_CALLS]",),
                                   custom_samplers=(StartText(opener),))  # fmt: skip
    assert result.text.strip() == "[TOOL_CALLS] done"


def test_a_call_nested_past_the_recursion_limit_is_left_as_content() -> None:
    # A model's answer can nest without end (forced by a grammar here in the hunt that found
    # it): json.loads raised RecursionError out of create_chat_completion, the answer lost.
    deep = "[" * 1500 + "]" * 1500
    text = f'<tool_call>{{"name": "f", "arguments": {{"a": {deep}}}}}</tool_call>'
    assert parse_tool_calls(text) == (text, [])
    generic = f'{{"tool_call": {{"name": "f", "arguments": {{"a": {deep}}}}}}}'
    assert parse_generic(generic) == (generic, [])
    with pytest.raises(InvalidParameterError, match="text must be a string, not None"):
        parse_tool_calls(None)  # type: ignore[arg-type]


def test_a_streamed_chat_keeps_the_logprobs_of_what_it_held_back(llm: Llama) -> None:
    # A call's text (and text a stop string may still end) is held back; its chunks' logprobs
    # were dropped with them: a streamed forced call had 1 entry where the answer had 53.
    messages = [{"role": "user", "content": "weather?"}]
    options = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 100, "seed": 2,
               "logprobs": 2}  # fmt: skip
    whole = llm.create_chat_completion(messages, **options).choices[0]
    chunks = list(llm.stream_chat_completion(messages, **options))
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert whole.logprobs is not None and whole.message.tool_calls
    assert sum(len(p.tokens) for p in streamed) == len(whole.logprobs.tokens) > 5
    assert tuple(t for p in streamed for t in p.tokens) == whole.logprobs.tokens
