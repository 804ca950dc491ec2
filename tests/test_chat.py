"""Chat: the model's own template in a sandbox, built-in formats, and chat completion."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llamacrab import ChatCompletion, InvalidParameterError, Llama, RamCache, TemplateError
from llamacrab._features.chat import chat_tokens

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def templated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Llama]:
    path = tiny.write_tiny_llama(
        tmp_path_factory.mktemp("chat") / "tiny-chat.gguf",
        chat_templates={"": TEMPLATE, "tool_use": "{{ messages | length }} messages"},
    )
    with Llama(path, n_ctx=128, n_threads=2) as llm:
        yield llm


def test_the_models_own_template_is_the_default(templated: Llama) -> None:
    assert templated.chat_prompt(HELLO) == "<s><system>Be brief.</s><user>Hi!</s><assistant>"
    # The variant never shows a system message: as llama.cpp does, it joins the user's.
    assert templated.chat_prompt(HELLO, "tokenizer.chat_template.tool_use") == "1 messages"
    # The template wrote BOS itself: the tokenizer must not add a second one.
    tokens = chat_tokens(templated.model, templated._media, HELLO, None)
    assert tokens[0] == templated.vocab.bos and tokens[1] != templated.vocab.bos


def test_built_in_and_custom_formats(tiny_llama: Llama) -> None:
    assert tiny_llama.chat_prompt(HELLO, "chatml") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tiny_llama.chat_prompt(HELLO, "alpaca").endswith(
        "### Instruction:\nHi!\n\n### Response:\n"
    )
    assert tiny_llama.chat_prompt(HELLO[1:], "{{ messages[-1].content }}!") == "Hi!!"
    # A template that never shows a system message gets it joined to the next (llama.cpp's way).
    assert tiny_llama.chat_prompt(HELLO, "{{ messages[-1].content }}!") == "Be brief.\nHi!!"
    with pytest.raises(TemplateError, match="no chat format 'nope'"):
        tiny_llama.chat_prompt(HELLO, "nope")
    with pytest.raises(TemplateError, match="has no chat template: pass chat_format"):
        tiny_llama.chat_prompt(HELLO)  # no template and not a gemma: never a silent generic one


def test_chat_completion_and_streaming(templated: Llama) -> None:
    result = templated.create_chat_completion(HELLO, max_tokens=4, temperature=0)
    assert result.choices[0].message.role == "assistant"
    assert result.id.startswith("chatcmpl-") and result.usage.completion_tokens <= 4
    templated.reset()
    chunks = list(templated.stream_chat_completion(HELLO, max_tokens=4, temperature=0))
    templated.reset()
    again = templated.create_chat_completion(HELLO, max_tokens=4, temperature=0)
    assert chunks[0].delta.role == "assistant" and all(c.delta.role is None for c in chunks[1:])
    assert "".join(c.delta.content for c in chunks) == again.text
    assert chunks[-1].finish_reason == again.choices[0].finish_reason


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ bos_token.__class__.__base__ }}",
        "{% set x = messages.append(1) %}",
        "{{ raise_exception('no system role') }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
        "{% if %}",
    ],
)
def test_hostile_or_broken_templates_raise(tiny_llama: Llama, template: str) -> None:
    with pytest.raises(TemplateError):
        tiny_llama.chat_prompt(HELLO, template)


def test_messages_are_checked(templated: Llama) -> None:
    with pytest.raises(InvalidParameterError, match="role 'robot'"):
        templated.chat_prompt([{"role": "robot", "content": "x"}])
    with pytest.raises(InvalidParameterError, match="image_url"):
        templated.chat_prompt([{"role": "user", "content": [{"type": "image_url"}]}])
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i!"}]}
    ]
    assert templated.chat_prompt(parts) == "<s><user>Hi!</s><assistant>"
    # An assistant's refusal part (OpenAI's SDK types it) is what it said.
    refused = [*parts, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}]
    closed = templated.chat_prompt(refused, prefill_assistant=False)
    assert closed.startswith("<s><user>Hi!</s><assistant>No.</s>")
    assert templated.chat_prompt(refused) == "<s><user>Hi!</s><assistant>No."  # continued
    with pytest.raises(InvalidParameterError, match="'refusal'"):
        templated.chat_prompt([{"role": "user", "content": [{"type": "refusal"}]}])


OPENED = [*HELLO, {"role": "assistant", "content": "Hello, I"}]
PREFILLED = "<s><system>Be brief.</s><user>Hi!</s><assistant>Hello, I"


def test_a_last_assistant_message_is_continued(templated: Llama) -> None:
    """As llama-server continues it (an assistant "prefill"): the turns before it with the
    generation prompt, then its text, no end of turn; the answer is what follows that text.
    The chat closed that turn and opened a new one (the model said it again)."""
    assert templated.chat_prompt(OPENED) == PREFILLED
    assert templated.chat_prompt(OPENED, prefill_assistant=False) == PREFILLED + "</s><assistant>"
    tokens = templated.tokenize(PREFILLED, add_special=False, parse_special=True)
    assert chat_tokens(templated.model, templated._media, OPENED, None) == tokens
    templated.reset()
    expected = templated.create_completion(tokens, max_tokens=4, temperature=0)
    templated.reset()
    answer = templated.create_chat_completion(OPENED, max_tokens=4, temperature=0)
    assert answer.text == expected.text and answer.usage.prompt_tokens == len(tokens)
    assert templated.count_chat_tokens(OPENED) == len(tokens)
    templated.reset()
    streamed = templated.stream_chat_completion(OPENED, max_tokens=4, temperature=0)
    assert "".join(chunk.delta.content for chunk in streamed) == expected.text
    closed = templated.tokenize(PREFILLED + "</s><assistant>", add_special=False,
                                parse_special=True)  # fmt: skip
    assert templated.count_chat_tokens(OPENED, prefill_assistant=False) == len(closed)
    # An empty one continues nothing: the prompt is the one without it.
    empty = [*HELLO, {"role": "assistant", "content": ""}]
    assert templated.chat_prompt(empty) == templated.chat_prompt(HELLO)
    # An assistant message alone is a turn, as before; so is one of tool calls (no text to go
    # on from; llama-server refuses it, and a Responses input may end with a call).
    alone = [{"role": "assistant", "content": "Hello"}]
    assert templated.chat_prompt(alone) == "<s><assistant>Hello</s><assistant>"
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert templated.chat_prompt(called) == templated.chat_prompt(called, prefill_assistant=False)
    # The last of two is continued after the other (llama-server refuses two).
    twice = [*HELLO, {"role": "assistant", "content": "Hi."}, OPENED[-1]]
    assert templated.chat_prompt(twice) == PREFILLED.replace("<assistant>", "<assistant>Hi.</s>"
                                                             "<assistant>")  # fmt: skip


def test_the_answers_turn_is_left_unopened_when_asked(templated: Llama) -> None:
    """``add_generation_prompt=False`` (the Jinja variable, llama-server's body field): the chat
    methods decode the prompt ``chat_prompt`` renders for it, the turns closed and none
    opened, and the answer is what follows. They took no such keyword (the completion's
    keywords refused it); the default still opens the turn."""
    unopened = templated.chat_prompt(HELLO, add_generation_prompt=False)
    assert unopened == "<s><system>Be brief.</s><user>Hi!</s>"
    tokens = templated.tokenize(unopened, add_special=False, parse_special=True)
    templated.reset()
    expected = templated.create_completion(tokens, max_tokens=4, temperature=0)
    options: dict[str, Any] = {"add_generation_prompt": False}
    templated.reset()
    answer = templated.create_chat_completion(HELLO, max_tokens=4, temperature=0, **options)
    assert answer.text == expected.text and answer.usage.prompt_tokens == len(tokens)
    templated.reset()
    streamed = templated.stream_chat_completion(HELLO, max_tokens=4, temperature=0, **options)
    assert "".join(chunk.delta.content for chunk in streamed) == expected.text
    assert templated.count_chat_tokens(HELLO, **options) == len(tokens)
    opened = templated.tokenize(templated.chat_prompt(HELLO), add_special=False,
                                parse_special=True)  # fmt: skip
    assert templated.count_chat_tokens(HELLO) == len(opened) > len(tokens)
    # A grammar shapes the answer after the closed turns as after an opened one.
    shaped = templated.create_chat_completion(HELLO, response_format={"type": "json_object"},
                                              max_tokens=1, **options)  # fmt: skip
    assert shaped.text.startswith("{") and shaped.usage.prompt_tokens == len(tokens)
    # A continued assistant message is in the answer's turn: continued all the same.
    assert templated.count_chat_tokens(OPENED, **options) == templated.count_chat_tokens(OPENED)
    with pytest.raises(InvalidParameterError, match="add_generation_prompt"):
        templated.count_chat_tokens(HELLO, add_generation_prompt="no")


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("messages", "options", "words"),
    [
        ([*HELLO, {"role": "assistant", "content": [{"type": "image_url"}]}], {}, "text only"),
        # A grammar for the whole answer would have to take the prefill in.
        (OPENED, {"response_format": {"type": "json_object"}}, "response_format"),
        (OPENED, {"tools": [TOOL]}, "cannot present"),  # the generic format: JSON answers
    ],
)
def test_what_cannot_be_continued_is_refused(
    templated: Llama, messages: list[dict[str, Any]], options: dict[str, Any], words: str
) -> None:
    for call in (templated.count_chat_tokens, templated.create_chat_completion):
        with pytest.raises(InvalidParameterError, match=words):
            call(messages, max_tokens=1, **options)
    if options:  # closed, as before, it is a turn like any other
        templated.count_chat_tokens(messages, prefill_assistant=False, **options)


def test_continued_formats_that_leave_the_prefill_free(templated: Llama) -> None:
    # Tools left out ("none"); an empty prefill, which a format may shape from its start.
    hidden = templated.create_chat_completion(OPENED, tools=[TOOL], tool_choice="none",
                                              max_tokens=2, temperature=0)  # fmt: skip
    assert hidden.usage.prompt_tokens == templated.count_chat_tokens(OPENED)
    empty = [*HELLO, {"role": "assistant", "content": ""}]
    shaped = templated.create_chat_completion(
        empty, response_format={"type": "json_object"}, max_tokens=1
    )
    assert shaped.text.startswith("{")


def test_chat_template_kwargs_are_template_variables(tiny_llama: Llama) -> None:
    template = (
        "{{ messages[0].content }}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
    )
    hello = [{"role": "user", "content": "Hi"}]
    off = {"enable_thinking": False}
    assert tiny_llama.chat_prompt(hello, template, chat_template_kwargs=off) == "Hi/no_think"
    assert (
        tiny_llama.chat_prompt(hello, template, chat_template_kwargs={"enable_thinking": 1}) == "Hi"
    )
    counted = [
        tiny_llama.create_chat_completion(hello, chat_format=template, max_tokens=1,
                                          chat_template_kwargs=kwargs).usage.prompt_tokens
        for kwargs in (off, None)
    ]  # fmt: skip
    assert counted[0] > counted[1]
    for bad, words in (({"tools": []}, "set by the chat itself"), ({"a b": 1}, "not a variable")):
        with pytest.raises(InvalidParameterError, match=words):
            tiny_llama.create_chat_completion(hello, chat_format=template, chat_template_kwargs=bad)


def test_chat_template_kwargs_may_have_the_names_of_llamacrabs_own_parameters(
    tiny_llama: Llama,
) -> None:
    """A template variable named like a parameter of the functions rendering the prompt
    (``model``, ``chat_format``, ``source``) was a TypeError, a 500 on the server."""
    template = "{{ messages[0].content }}:{{ model }}{{ chat_format }}{{ source }}"
    hello = [{"role": "user", "content": "Hi"}]
    for name in ("model", "chat_format", "source"):
        kwargs = {name: "X"}
        assert tiny_llama.chat_prompt(hello, template, chat_template_kwargs=kwargs) == "Hi:X"


@pytest.mark.real_model
def test_gemma_without_a_template_gets_the_gemma_format(gemma: Llama) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = gemma.chat_prompt(question)
    assert prompt == (
        "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    )
    tokens = chat_tokens(gemma.model, gemma._media, question, None)
    assert tokens[:2] == [gemma.vocab.bos, gemma.vocab.tokenize("<start_of_turn>", False, True)[0]]
    first = gemma.create_chat_completion(question, max_tokens=8, temperature=0)
    follow_up = [*question, {"role": "assistant", "content": first.text},
                 {"role": "user", "content": "And of Germany?"}]  # fmt: skip
    second = gemma.create_chat_completion(follow_up, max_tokens=8, temperature=0)
    assert second.usage.cached_tokens >= len(tokens) - 1  # the first turn was reused
    assert second.choices[0].finish_reason in ("eos", "length")


def test_counted_chat_tokens_are_the_prompt_a_completion_decodes(gemma: Llama) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    cases: list[dict[str, object]] = [
        {},
        {"tools": tools},  # Gemma's template cannot present them: a generic-format system turn
        {"tools": tools, "tool_choice": "none"},  # ... which "none" leaves out
        {"tools": tools, "tool_choice": "required", "max_tokens": 4, "temperature": 0},
        {"response_format": {"type": "json_object"}},
    ]
    counts = []
    for case in cases:
        count = gemma.count_chat_tokens(question, **case)  # type: ignore[arg-type]
        answer = gemma.create_chat_completion(question, **{"max_tokens": 1, **case})  # type: ignore[arg-type]
        assert count == answer.usage.prompt_tokens, case
        counts.append(count)
    assert counts[0] == counts[2] < counts[1]
    # What a completion refuses, the count refuses alike.
    for bad in (
        {"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}},
        {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    ):
        for call in (gemma.count_chat_tokens, gemma.create_chat_completion):
            with pytest.raises(InvalidParameterError):
                call(question, **bad)  # type: ignore[operator]
    with pytest.raises(InvalidParameterError, match="role"):
        gemma.count_chat_tokens([{"role": "nobody", "content": "hi"}])


def test_async_chat_stream(templated: Llama) -> None:
    import asyncio

    async def collect() -> list[str]:
        stream = templated.astream_chat_completion(HELLO, max_tokens=4, temperature=0)
        return [chunk.delta.content async for chunk in stream]

    templated.reset()
    pieces = asyncio.run(collect())
    templated.reset()
    assert (
        "".join(pieces) == templated.create_chat_completion(HELLO, max_tokens=4, temperature=0).text
    )


@pytest.mark.real_model
def test_a_new_question_after_the_same_document_resumes_at_its_start(gemma_path: Path) -> None:
    """A sliding-window model keeps a checkpoint where the last message's text starts (for
    Gemma, after the system text, which its template puts inside the same user turn). A second
    question after the same document, served from a prompt cache, decodes only itself
    (without that checkpoint: 4 + 512 tokens before the first prompt's end, and the question),
    and answers as a fresh memory does."""
    document = " ".join(f"Entry {i}: crab {i} guards rock {i % 9}." for i in range(110))
    with Llama(gemma_path, n_ctx=4096, n_threads=2, cache=RamCache()) as llm:

        def ask(question: str) -> ChatCompletion:
            messages = [{"role": "system", "content": document},
                        {"role": "user", "content": question}]  # fmt: skip
            return llm.create_chat_completion(messages, max_tokens=6, temperature=0)

        ask("Which rock does crab 3 guard?")
        llm.reset()  # only the cache can help now
        second = ask("Which rock does crab 40 guard?")
        assert second.usage.prompt_tokens > 1500
        assert second.usage.prompt_tokens - second.usage.cached_tokens < 20
        llm.cache = None
        llm.reset()
        fresh = ask("Which rock does crab 40 guard?")
        assert fresh.choices[0].message.content == second.choices[0].message.content


def test_checkpoint_positions_are_checked(tiny_llama: Llama) -> None:
    n = len(tiny_llama.tokenize("the cat sat"))
    for bad in ([0], [n], ["1"], [True]):
        with pytest.raises(InvalidParameterError, match="checkpoint_at"):
            tiny_llama.create_completion("the cat sat", max_tokens=1, checkpoint_at=bad)
    done = tiny_llama.create_completion("the cat sat", max_tokens=1, checkpoint_at=[1])
    assert done.usage.completion_tokens == 1  # no sliding window: nothing to take
