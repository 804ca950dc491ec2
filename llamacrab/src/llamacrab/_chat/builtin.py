"""Built-in chat formats for models whose GGUF carries no template.

Most are llama.cpp's own (``llama_chat_apply_template``); the few it lacks are small Jinja
templates rendered in the same sandbox as a model's. Names follow common usage; llama.cpp's
names work too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llamacrab._exceptions import TemplateError
from llamacrab._native.chat_format import apply_llama_cpp_format, llama_cpp_format_names

# Our names for llama.cpp's templates.
ALIASES = {
    "mistral-instruct": "mistral-v7",
    "llama-3": "llama3",
    "phi-3": "phi3",
}

OWN_TEMPLATES = {
    "alpaca": (
        "{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}\n\n"
        "{% elif m.role == 'user' %}### Instruction:\n{{ m.content }}\n\n"
        "{% else %}### Response:\n{{ m.content }}\n\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}### Response:\n{% endif %}"
    ),
    "oasst_llama": (
        "{% for m in messages %}{% if m.role == 'system' %}[INST] <<SYS>>\n{{ m.content }}\n"
        "<</SYS>>\n\n{% elif m.role == 'user' %}<|prompter|>{{ m.content }}</s>"
        "{% else %}<|assistant|>{{ m.content }}</s>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    ),
    "plain": ("{% for m in messages %}{{ m.content }}\n{% endfor %}"),
}


def builtin_names() -> list[str]:
    return sorted({*llama_cpp_format_names(), *ALIASES, *OWN_TEMPLATES})


def apply_builtin(
    name: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool
) -> str:
    if name in OWN_TEMPLATES:
        from llamacrab._chat.template import render  # Jinja2 loads with the first template

        return render(OWN_TEMPLATES[name], messages, add_generation_prompt=add_generation_prompt)
    llama_name = ALIASES.get(name, name)
    if llama_name not in llama_cpp_format_names():
        raise TemplateError(
            f"no built-in chat format {name!r}; known: {', '.join(builtin_names())}"
        )
    return apply_llama_cpp_format(llama_name, messages, add_generation_prompt)
