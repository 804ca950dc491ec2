"""Tools on a template that cannot present them: llama.cpp's generic tool format (a system
message, a grammar-constrained JSON answer, parsed back into calls or content)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from test_tool_calls import WEATHER, StartText

from llamacrab import Llama
from llamacrab._chat.generic_tools import INSTRUCTION, GenericSplitter, parse_generic

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"}]
# No arguments: a random model cannot ramble on in an open-ended object.
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}  # fmt: skip


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Llama]:
    """A model without a chat template: chatml (a built-in format) cannot present tools."""
    path = tiny.write_tiny_llama(tmp_path_factory.mktemp("generic") / "tiny.gguf")
    with Llama(path, n_ctx=2048, n_threads=2) as model:
        yield model


def test_the_system_message_presents_the_tools_and_the_shape_of_a_call(llm: Llama) -> None:
    prompt = llm.chat_prompt(ASK, "chatml", tools=[WEATHER])
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n" + INSTRUCTION)
    listed = system.split("requests: ", 1)[1].split("\n\nExample tool call syntax:")[0]
    assert json.loads(listed) == [WEATHER]
    example = json.loads(system.split("Example tool call syntax:\n\n", 1)[1])
    assert set(example) == {"tool_call"} and set(example["tool_call"]) == {"name", "arguments"}
    assert prompt.endswith("<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n")
    # tool_choice "none": the tools are not presented at all.
    plain = llm.create_chat_completion(ASK, chat_format="chatml", tools=[WEATHER],
                                       tool_choice="none", max_tokens=2)  # fmt: skip
    assert plain.usage.prompt_tokens == len(llm.tokenize(llm.chat_prompt(ASK, "chatml")))


def test_past_calls_and_results_are_shown_as_json(llm: Llama) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "Sunny"},
    ]
    turns = llm.chat_prompt(history, "chatml").split("<|im_end|>\n")
    assert json.loads(turns[1].removeprefix("<|im_start|>assistant\n")) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_1"}]
    }
    assert json.loads(turns[2].removeprefix("<|im_start|>user\n")) == {
        "tool_response": {"tool": "get_weather", "content": "Sunny", "tool_call_id": "call_1"}
    }


@pytest.mark.parametrize("seed", range(3))
def test_a_required_call_always_parses(llm: Llama, seed: int) -> None:
    result = llm.create_chat_completion(ASK, chat_format="chatml", tools=[WEATHER, TIME],
                                        tool_choice="required", max_tokens=400, temperature=1.0,
                                        seed=seed)  # fmt: skip
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.name in ("get_weather", "get_time") and choice.message.content is None
    if call.name == "get_weather":
        assert json.loads(call.arguments)["city"] in ("Paris", "Lisbon")


def test_a_named_call(llm: Llama) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    result = llm.create_chat_completion(
        ASK, chat_format="chatml", tools=[WEATHER, TIME], tool_choice=named, max_tokens=400,
        temperature=0,
    )  # fmt: skip
    assert [c.name for c in result.choices[0].message.tool_calls] == ["get_weather"]


def test_auto_answers_with_a_call_or_a_response(llm: Llama) -> None:
    opener = llm.tokenize('{"response": "', add_special=False)[1:]  # not the leading space

    def answer(**kwargs: object) -> object:
        return llm.create_chat_completion(ASK, chat_format="chatml", tools=[WEATHER],
                                          tool_choice="auto", max_tokens=60, temperature=1.0,
                                          seed=4, custom_samplers=(StartText(opener),),
                                          **kwargs)  # fmt: skip

    whole = answer()
    choice = whole.choices[0]  # type: ignore[attr-defined]
    assert choice.message.tool_calls == () and choice.message.content  # the response, unwrapped
    assert not choice.message.content.startswith("{")
    stream = llm.stream_chat_completion(
        ASK, chat_format="chatml", tools=[WEATHER], tool_choice="auto", max_tokens=60,
        temperature=1.0, seed=4, custom_samplers=(StartText(opener),),
    )  # fmt: skip
    chunks = list(stream)
    pieces = [c.delta.content for c in chunks if c.delta.content]
    assert len(pieces) > 3  # the response streams as it is generated
    assert "".join(pieces) == choice.message.content
    if choice.finish_reason == "eos":  # the grammar closed the JSON object
        assert chunks[-1].finish_reason == "eos"


def test_auto_with_a_response_format_constrains_the_response(llm: Llama) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    opener = llm.tokenize('{"response": {', add_special=False)[1:]
    result = llm.create_chat_completion(
        ASK, chat_format="chatml", tools=[WEATHER], tool_choice="auto", max_tokens=200,
        temperature=0, custom_samplers=(StartText(opener),),
        response_format={"type": "json_schema", "json_schema": {"schema": schema}},
    )  # fmt: skip
    assert json.loads(result.choices[0].message.content or "")["ok"] in (True, False)


def test_generic_answers_parse() -> None:
    call = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
    content, calls = parse_generic(call)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    several = '{"tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]}'
    assert [c.name for c in parse_generic(several)[1]] == ["a", "b"]
    assert parse_generic('{"response": "Hi\\nthere"}') == ("Hi\nthere", [])
    assert parse_generic('{"response": {"ok": true}}') == ('{\n  "ok": true\n}', [])
    assert parse_generic("plain words") == ("plain words", [])
    # A call cut short (max_tokens) before its name is whole is neither content nor a call:
    # its JSON is ours, not the user's text. Once named, it is the call so far (as OpenAI).
    for cut in ('{\n  "tool_call": {\n    "name": "get_', '{"tool_c', "{\n  ", "{"):
        assert parse_generic(cut) == ("", []), cut
    content, calls = parse_generic('{"tool_call": {"name": "get_time", "arguments": {"a')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", '{"a')]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_is_the_call_so_far(llm: Llama, stream: bool) -> None:
    """Each budget shorter than the call: no content, finish "length", and once the name is
    whole, that call with the arguments' text so far (not JSON yet); then the whole call."""
    kwargs: Any = {"chat_format": "chatml", "tools": [WEATHER], "tool_choice": "required",
                   "temperature": 0}  # fmt: skip
    whole = llm.create_chat_completion(ASK, max_tokens=400, **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    final = re.sub(r"\s", "", whole.message.tool_calls[0].arguments)
    named = unnamed = 0
    for budget in range(1, 200):
        if stream:
            chunks = list(llm.stream_chat_completion(ASK, max_tokens=budget, **kwargs))
            content = "".join(c.delta.content for c in chunks)
            finish = chunks[-1].finish_reason
            calls = [c for k in chunks for c in k.delta.tool_calls]
        else:
            choice = llm.create_chat_completion(ASK, max_tokens=budget, **kwargs).choices[0]
            content, finish = choice.message.content or "", choice.finish_reason
            calls = list(choice.message.tool_calls)
        if finish == "tool_calls":
            break
        assert (content, finish) == ("", "length")
        if calls:
            assert [c.name for c in calls] == ["get_weather"]
            assert final.startswith(re.sub(r"\s", "", calls[0].arguments)), calls[0].arguments
        named, unnamed = named + bool(calls), unnamed + (not calls)
    assert named and unnamed


@pytest.mark.parametrize(
    "pieces",
    [
        ['{"resp', 'onse": "Caf', "\\u00e9 ", "\\ud83d", "\\ude00 ", 'a\\"b\\\\c\\n', '"}'],
        [' {\n  "response"', ":", ' "Caf\\u', "00e9 \\ud83d\\ude00 ", 'a\\"b\\\\c\\n"\n}'],
    ],
)
def test_a_streamed_response_is_decoded_as_it_arrives(pieces: list[str]) -> None:
    splitter = GenericSplitter()
    emitted = [splitter.push(p) for p in pieces]
    rest, calls = splitter.finish()
    assert "".join(emitted) + rest == 'Café 😀 a"b\\c\n' and calls == []
    assert sum(1 for e in emitted if e) >= 2  # not all at the end


def test_a_streamed_call_is_held_and_parsed() -> None:
    splitter = GenericSplitter()
    text = '{"tool_call": {"name": "get_time", "arguments": {}}}'
    assert "".join(splitter.push(text[i : i + 5]) for i in range(0, len(text), 5)) == ""
    content, calls = splitter.finish()
    assert content == "" and [c.name for c in calls] == ["get_time"]
    other = GenericSplitter()  # not JSON (a grammar of the caller's own): all content
    assert other.push("Hello") + other.push(" there") == "Hello there"
    assert other.finish() == ("", [])
