"""Every chat template in the pinned llama.cpp source (``models/templates/*.jinja``) renders a
conversation with a system message, tools, an assistant's tool call and its result.

The templates are read from the pinned source tree where the build finds it
(``build_tools.source.resolve_source``: a local checkout, the cache, or the pinned sdist,
fetched and verified as the build does); nothing is copied into this repository.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from llamacrab._chat.caps import template_caps
from llamacrab._chat.generic_tools import INSTRUCTION
from llamacrab._chat.prompt import render_template

SYS_DIR = Path(__file__).resolve().parents[1] / "llamacrab-sys"
if str(SYS_DIR) not in sys.path:
    sys.path.insert(0, str(SYS_DIR))  # build_tools: how the build finds the pinned source

# Templates that need what llamacrab cannot give, with the reason (none today). Each is
# expected to fail; one that starts to render must be taken off the list.
UNSUPPORTED: dict[str, str] = {}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city's name."}}}}}]  # fmt: skip
# Mistral's templates take call ids of nine alphanumeric characters.
CALL = {"id": "call00001", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "Sunny, 24C"},
    {"role": "assistant", "content": "It is sunny in Paris."},
    {"role": "user", "content": "Thank you!"},
]
SHOWN = ("You are a weather assistant.", "What is the weather in Paris?", "get_weather", "Paris",
         "Sunny, 24C", "It is sunny in Paris.", "Thank you!")  # fmt: skip


def _corpus() -> list[Any]:
    try:
        from build_tools.source import resolve_source

        root = resolve_source().path / "models" / "templates"
    except Exception as error:  # reported by the test below, never skipped
        return [pytest.param(None, error, id="pinned-source-unavailable")]
    return [pytest.param(path, None, id=path.name) for path in sorted(root.glob("*.jinja"))]


CORPUS = _corpus()


def test_the_corpus_is_the_pinned_sources() -> None:
    assert len(CORPUS) >= 60, [p.id for p in CORPUS]


@pytest.mark.parametrize(("path", "problem"), CORPUS)
def test_each_template_renders_a_conversation_with_tools(
    path: Path | None, problem: Exception | None
) -> None:
    if path is None:
        pytest.fail(f"the pinned llama.cpp source is unavailable: {problem}")
    if path.name in UNSUPPORTED:
        pytest.xfail(UNSUPPORTED[path.name])
    source = path.read_text(encoding="utf-8")
    prompt = render_template(source, CONVERSATION, tools=TOOLS, bos_token="<s>",
                             eos_token="</s>")  # fmt: skip
    missing = [text for text in SHOWN if text not in prompt]
    assert not missing, f"{path.name} left out {missing}:\n{prompt}"
    assert '\\"city\\"' not in prompt, f"{path.name}: the arguments were escaped twice"
    caps = template_caps(source)
    # Tools the template cannot show are described in llama.cpp's generic format.
    assert (INSTRUCTION in prompt) == (not caps.tools)
    with_prompt = render_template(source, CONVERSATION[:2], tools=TOOLS)
    assert "What is the weather in Paris?" in with_prompt
