"""Runs LangChain's and LlamaIndex's llama.cpp integrations, unmodified from PyPI, on the
``llama_cpp`` alias of llamacrab.compat, with real models. Run by
tests/test_compat_frameworks.py in its own process:

    python compat_frameworks_driver.py OUT.jsonl GEMMA.gguf MINILM.gguf FOLDER...

Each check appends one JSON line to OUT.jsonl: {"name", "ok", "detail", "seconds"}.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT, GEMMA, MINILM = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path.extend(sys.argv[4:])  # after this environment's own site-packages

import llamacrab.compat  # noqa: E402

llamacrab.compat.install()  # what a user of these frameworks adds: nothing else changes
warnings.simplefilter("ignore")  # langchain-community announces its own sunset

PROMPT = "Paris is the capital of"
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


def check(name: str) -> Callable[[Callable[[], object]], None]:
    """Run the function now and record what it returned (its detail) or raised."""

    def run(function: Callable[[], object]) -> None:
        started = time.perf_counter()
        try:
            detail, ok = repr(function())[:500], True
        except Exception:
            detail, ok = traceback.format_exc()[-3000:], False
        line = {"name": name, "ok": ok, "detail": detail,
                "seconds": round(time.perf_counter() - started, 2)}  # fmt: skip
        with OUT.open("a") as out:
            out.write(json.dumps(line) + "\n")

    return run


def expect(condition: bool, what: Any) -> None:
    if not condition:
        raise AssertionError(what)


# -- LangChain: LlamaCpp ----------------------------------------------------------------------

from langchain_community.chat_models import ChatLlamaCpp  # noqa: E402
from langchain_community.embeddings import LlamaCppEmbeddings  # noqa: E402
from langchain_community.llms import LlamaCpp  # noqa: E402
from langchain_core.messages import HumanMessage  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

llm = LlamaCpp(model_path=GEMMA, n_ctx=512, max_tokens=12, temperature=0, verbose=False)
greedy = llamacrab.compat.Llama(GEMMA, n_ctx=512, verbose=False)


@check("langchain LlamaCpp.invoke")
def _() -> object:
    answer = llm.invoke(PROMPT)
    # LangChain passes its own defaults (repeat_penalty 1.1, rope_freq_base 10000, n_batch 8):
    # the same keywords given to compat.Llama directly must give the same text.
    with llamacrab.compat.Llama(GEMMA, n_ctx=512, n_batch=8, rope_freq_base=10000.0,
                                rope_freq_scale=1.0, verbose=False) as same:  # fmt: skip
        direct = same(PROMPT, max_tokens=12, temperature=0, repeat_penalty=1.1, top_p=0.95,
                      top_k=40)["choices"][0]["text"]  # fmt: skip
    expect(isinstance(answer, str) and answer == direct and len(answer) > 5, (answer, direct))
    return answer


@check("langchain LlamaCpp.stream")
def _() -> object:
    pieces = list(llm.stream(PROMPT))
    expect(len(pieces) > 3 and "".join(pieces) == llm.invoke(PROMPT), pieces)
    return pieces


@check("langchain LlamaCpp.batch")
def _() -> object:
    prompts = [PROMPT, "Berlin is the capital of"]
    answers = llm.batch(prompts)
    expect(answers == [llm.invoke(p) for p in prompts], answers)
    return answers


@check("langchain LlamaCpp stop and get_num_tokens")
def _() -> object:
    answer = llm.invoke("One, two, three, four,", stop=[","])
    expect("," not in answer and answer.strip(), answer)
    expect(llm.get_num_tokens(PROMPT) == len(greedy.tokenize(PROMPT.encode())), "tokens")
    return answer


@check("langchain LlamaCpp grammar")
def _() -> object:
    constrained = LlamaCpp(model_path=GEMMA, n_ctx=512, max_tokens=4, verbose=False,
                           grammar='root ::= "yes" | "no"')  # fmt: skip
    answer = constrained.invoke("Is the sky blue? Answer:")
    expect(answer in ("yes", "no"), answer)
    return answer


# -- LangChain: ChatLlamaCpp ------------------------------------------------------------------

chat = ChatLlamaCpp(model_path=GEMMA, n_ctx=512, max_tokens=24, temperature=0, verbose=False,
                    model_kwargs={"chat_format": TOOLS_TEMPLATE})  # fmt: skip
QUESTION = [HumanMessage(content="What is the weather in Lisbon?")]


@check("langchain ChatLlamaCpp.invoke")
def _() -> object:
    message = chat.invoke(QUESTION)
    expect(message.type == "ai" and isinstance(message.content, str) and message.content, message)
    expect(message.response_metadata.get("finish_reason") in ("stop", "length"), message)
    return message.content


@check("langchain ChatLlamaCpp.stream")
def _() -> object:
    chunks = list(chat.stream(QUESTION))
    expect(len(chunks) > 3, chunks)
    expect("".join(str(c.content) for c in chunks) == chat.invoke(QUESTION).content, chunks)
    return [c.content for c in chunks]


@check("langchain ChatLlamaCpp.batch (threads)")
def _() -> object:
    inputs = [QUESTION, [HumanMessage(content="Name a sea animal.")]] * 2
    answers = [m.content for m in chat.batch(inputs)]  # a thread per input
    expect(answers == [chat.invoke(i).content for i in inputs], answers)
    return answers


@check("langchain ChatLlamaCpp.bind_tools")
def _() -> object:
    with_tools = chat.bind_tools([WEATHER], tool_choice="get_weather")
    message = with_tools.invoke(QUESTION)
    (call,) = message.tool_calls
    expect(call["name"] == "get_weather" and set(call["args"]) == {"city"}, message)
    return message.tool_calls


class Weather(BaseModel):
    """The weather question, as a structure."""

    city: str = Field(max_length=20)


@check("langchain ChatLlamaCpp.with_structured_output")
def _() -> object:
    structured = chat.with_structured_output(Weather)
    answer = structured.invoke(QUESTION)
    expect(isinstance(answer, Weather) and answer.city, answer)
    return answer


# -- LangChain: LlamaCppEmbeddings ------------------------------------------------------------


@check("langchain LlamaCppEmbeddings")
def _() -> object:
    embeddings = LlamaCppEmbeddings(model_path=MINILM, n_threads=2, verbose=False)
    documents = ["Crabs walk sideways.", "Paris is the capital of France."]
    vectors = embeddings.embed_documents(documents)
    query = embeddings.embed_query("Which city is France's capital?")
    expect(len(vectors) == 2 and all(len(v) == 384 for v in vectors) and len(query) == 384, "")

    def cosine(a: list[float], b: list[float]) -> float:
        dot = sum(x * y for x, y in zip(a, b, strict=True))
        return float(dot / (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5)

    scores = [cosine(query, v) for v in vectors]
    expect(scores[1] > scores[0], scores)
    return scores


# -- LlamaIndex: LlamaCPP ---------------------------------------------------------------------

from llama_index.core.llms import ChatMessage  # noqa: E402
from llama_index.llms.llama_cpp import LlamaCPP  # noqa: E402

index_llm = LlamaCPP(model_path=GEMMA, temperature=0, max_new_tokens=12, context_window=512,
                     model_kwargs={"n_threads": 2}, verbose=False)  # fmt: skip


@check("llamaindex LlamaCPP.complete")
def _() -> object:
    response = index_llm.complete(PROMPT)
    expected = greedy(PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"]
    expect(response.text == expected and response.raw["object"] == "text_completion", response)
    expect(index_llm.metadata.context_window == 512, index_llm.metadata)
    return response.text


@check("llamaindex LlamaCPP.stream_complete")
def _() -> object:
    responses = list(index_llm.stream_complete(PROMPT))
    expect(len(responses) > 3 and responses[-1].text == index_llm.complete(PROMPT).text,
           responses)  # fmt: skip
    return [r.delta for r in responses]


@check("llamaindex LlamaCPP.chat")
def _() -> object:
    response = index_llm.chat([ChatMessage(role="user", content="Name a sea animal.")])
    expect(response.message.role == "assistant" and response.message.content, response)
    streamed = list(index_llm.stream_chat([ChatMessage(role="user", content="Hi")]))
    expect(len(streamed) > 1, streamed)
    return response.message.content
