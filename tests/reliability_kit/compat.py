"""llama-cpp-python's API (``llamacrab.compat``) with extreme and ill-typed values: one to three
keywords of its ``Llama`` (a load), ``create_completion``, ``create_chat_completion`` or
``sample()`` (its hand-written loop: ``eval()`` of valid or hostile tokens, perhaps a rewind
of ``n_tokens``, then samples each evaluated in turn), drawn from the parameters section's
pools (tests/reliability_kit/parameters.py) plus malformed messages, tools, tool choices,
legacy functions and response formats, and projector chat handlers (a marker the child makes
into one, whose clip_model_path names the tiny vision projector or a hostile path; a load with
one then chats with an image). Code written for
llama-cpp-python passes such values through unchecked; here each must be a LlamaError (the
compat layer's UnsupportedParameterError is one) naming the keyword, and the compat Llama
kept across the cases must answer afterwards.
"""

from __future__ import annotations

import random
from typing import Any

from reliability_kit.parameters import FLOATS, INTS, STRINGS, WRONG, drawn_value, with_files
from reliability_kit.usable import then_still_answers

LOAD: dict[str, tuple[str, list[Any]]] = {
    "n_gpu_layers": ("int", [0, -1]),
    "split_mode": ("int", [0, 1, 2]),
    "main_gpu": ("int", [0]),
    "tensor_split": ("floats", [[1.0]]),
    "use_mmap": ("bool", [True, False]),
    "use_mlock": ("bool", [False]),
    "kv_overrides": ("overrides", []),
    "seed": ("int", [0, 4294967295]),
    "n_ctx": ("int", [64, 128]),
    "n_batch": ("int", [1, 32]),
    "n_ubatch": ("int", [1, 32]),
    "n_threads": ("int", [1]),
    "n_threads_batch": ("int", [1]),
    "rope_scaling_type": ("int", [-1, 0, 1, 2]),
    "pooling_type": ("int", [-1, 0, 1, 2, 3, 4]),
    "attention_type": ("int", [-1]),
    "rope_freq_base": ("float", [0.0, 10000.0]),
    "rope_freq_scale": ("float", [0.0, 0.5]),
    "yarn_ext_factor": ("float", [-1.0]),
    "yarn_attn_factor": ("float", [1.0]),
    "yarn_beta_fast": ("float", [32.0]),
    "yarn_beta_slow": ("float", [1.0]),
    "yarn_orig_ctx": ("int", [0]),
    "logits_all": ("bool", [True, False]),
    "embedding": ("bool", [False]),
    "offload_kqv": ("bool", [True]),
    "flash_attn": ("bool", [True, False]),
    "op_offload": ("bool", [True]),
    "swa_full": ("bool", [True]),
    "no_perf": ("bool", [True]),
    "last_n_tokens_size": ("int", [64]),
    "lora_path": ("str", ["lora"]),
    "lora_scale": ("float", [0.5, 1.0]),
    "numa": ("bool", [False]),
    "chat_format": ("str", ["chatml", "llama-2", "chat_template.default"]),
    "type_k": ("str", ["f16", "q8_0", 1, 8]),
    "type_v": ("str", ["f16", 1]),
    "spm_infill": ("bool", [True]),
    "vocab_only": ("bool", [False, True]),
    "chat_handler": ("handler", []),
}
# llama-cpp-python's projector chat handlers, and what their clip_model_path names: the tiny
# vision or audio projector, another kind of file, a missing one, or no path at all.
HANDLERS = (
    "MTMDChatHandler",
    "Gemma4ChatHandler",
    "Llava15ChatHandler",
    "Llava16ChatHandler",
    "MoondreamChatHandler",
    "NanoLlavaChatHandler",
    "ObsidianChatHandler",
    "Llama3VisionAlphaChatHandler",
    "MiniCPMv26ChatHandler",
    "Qwen25VLChatHandler",
)
CLIPS: list[Any] = ["vision", "vision", "vision", "audio", "lora", "llama", "missing.gguf", "",
                    None, 5, -1, "x" * 5000, "vision\0"]  # fmt: skip
_SAMPLING: dict[str, tuple[str, list[Any]]] = {
    "max_tokens": ("int", [1, 4, 0, -1]),
    "temperature": ("float", [0.0, 0.8]),
    "top_p": ("float", [0.5]),
    "min_p": ("float", [0.05]),
    "typical_p": ("float", [0.9]),
    "stop": ("strings", [["."], "the", None]),
    "frequency_penalty": ("float", [0.5]),
    "presence_penalty": ("float", [0.5]),
    "repeat_penalty": ("float", [1.1]),
    "top_k": ("int", [1, 40]),
    "seed": ("int", [1, None]),
    "tfs_z": ("float", [1.0]),
    "mirostat_mode": ("int", [0, 1, 2]),
    "mirostat_tau": ("float", [5.0]),
    "mirostat_eta": ("float", [0.1]),
    "model": ("str", ["tiny"]),
    "logit_bias": ("bias", []),
    "grammar": ("str", ['root ::= "a" | "b"']),
    "stream": ("bool", [True, False]),
}
COMPLETION: dict[str, tuple[str, list[Any]]] = {
    **_SAMPLING,
    "suffix": ("str", [" end"]),
    "logprobs": ("int", [0, 2]),
    "echo": ("bool", [True]),
}
CHAT: dict[str, tuple[str, list[Any]]] = {
    **_SAMPLING,
    "messages": ("messages", []),
    "tools": ("tools", []),
    "functions": ("functions", []),
    "tool_choice": ("tool_choice", ["auto", "none"]),
    "function_call": ("tool_choice", ["auto"]),
    "response_format": ("response_format", [{"type": "json_object"}]),
    "logprobs": ("bool", [True, False]),
    "top_logprobs": ("int", [0, 2]),
}
# eval() then sample(): the tokens given to eval, and sample()'s keywords.
EVAL_TOKENS: list[Any] = [
    [1, 5, 30], [1, 5, 30], [1], [270], list(range(3, 200)), [],
    [271], [-1], [2**31 - 1], [5] * 300, "the cat", None, [1.5], [[1]],
]  # fmt: skip
SAMPLE: dict[str, tuple[str, list[Any]]] = {
    "top_k": ("int", [1, 40]),
    "top_p": ("float", [0.5]),
    "min_p": ("float", [0.05]),
    "typical_p": ("float", [0.9]),
    "temp": ("float", [0.0, 0.8]),
    "repeat_penalty": ("float", [1.1]),
    "frequency_penalty": ("float", [0.5]),
    "presence_penalty": ("float", [0.5]),
    "tfs_z": ("float", [1.0]),
    "mirostat_mode": ("int", [0, 1, 2]),
    "mirostat_tau": ("float", [5.0]),
    "mirostat_eta": ("float", [0.1]),
    "penalize_nl": ("bool", [True, False]),
    "idx": ("int", [0, 1, 2]),
}
_TOOL = {"type": "function", "function": {"name": "look", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}  # fmt: skip


def _chat_value(kind: str, rng: random.Random) -> Any:
    """A malformed (or, a third of the time, an ordinary) value of a chat-only keyword."""
    odd = rng.choice([*WRONG, *STRINGS[:3], *INTS[:2], [None], [5], [{}]])
    if kind == "messages":
        message = rng.choice([
            {"role": "user", "content": "hi"}, {"role": "bogus", "content": "hi"},
            {"role": "user"}, {"role": "user", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "user", "content": [{"type": "image_url"}]}, {"content": "hi"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "look"}}]},
            {"role": "tool", "content": "x", "tool_call_id": 5}, {"role": 5, "content": 5},
        ])  # fmt: skip
        return rng.choice([[message], [message] * 3, [], odd])
    if kind in ("tools", "functions"):
        tool = rng.choice([_TOOL, {"type": "function"}, {"type": "function", "function": {}},
                           {"type": "function", "function": {"name": 5}}, {"type": "bogus"},
                           {"function": {"name": "look", "parameters": "x"}}])  # fmt: skip
        function = tool.get("function", tool)
        return rng.choice([[tool if kind == "tools" else function], [], odd])
    if kind == "tool_choice":
        return rng.choice(["required", "look", "bogus", {"type": "function"},
                           {"type": "function", "function": {"name": "nope"}},
                           {"name": "look"}, {"x": 1}, odd])  # fmt: skip
    return rng.choice([  # response_format
        {"type": "json_object", "schema": {"type": "object"}}, {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}},
        {"type": "json_object", "schema": "x"}, {"type": "bogus"}, {"type": "text"}, {}, odd,
    ])  # fmt: skip


def _handler_value(rng: random.Random) -> Any:
    """A handler to make in the child (a JSON-able marker), or a value that is none."""
    if rng.random() < 0.15:
        return rng.choice(["chatml", 5, True, {"clip": "vision"}, [1]])
    handler = rng.choice(HANDLERS)
    marker = {"handler": handler, "clip": rng.choice(CLIPS)}
    if handler in ("MTMDChatHandler", "Gemma4ChatHandler"):
        marker["use_gpu"] = rng.choice([True, True, False])
    return marker


def _value(kind: str, ordinary: list[Any], rng: random.Random) -> Any:
    if kind == "handler":
        return _handler_value(rng)
    if kind in ("messages", "tools", "functions", "tool_choice", "response_format"):
        return rng.choice(ordinary) if ordinary and rng.random() < 0.33 else _chat_value(kind, rng)
    if kind == "str" and rng.random() < 0.3:
        return rng.choice(FLOATS[:2] + INTS[:2])  # a number where text belongs
    return drawn_value(kind, ordinary, rng)


def generate(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` cases: a load, a completion, a chat or an eval/sample loop, each with 1-3
    keywords drawn."""
    rng = random.Random(seed)
    tables = {"load": LOAD, "completion": COMPLETION, "chat": CHAT, "sample": SAMPLE}
    cases = []
    for i in range(count):
        where = rng.choice(["load", "completion", "completion", "chat", "chat", "chat", "sample"])
        table = tables[where]
        names = rng.sample(sorted(table), rng.choice((1, 1, 2, 3)))
        options = {name: _value(*table[name], rng) for name in names}
        case = {"id": f"compat-{seed}-{i}", "where": where, "options": options}
        if where == "sample":  # what eval() decodes first, and where n_tokens rewinds to
            case["tokens"] = rng.choice(EVAL_TOKENS)
            case["rewind"] = rng.choice([None] * 6 + [0, 1, 3, -1, 10**6, 2.5, "2"])
        cases.append(case)
    return cases


# -- the child's side ----------------------------------------------------------------------------


def setup(config: dict[str, Any], slot: int) -> dict[str, Any]:
    """The compat Llama kept for completion and chat cases, and the files."""
    from llamacrab.compat import Llama

    files = config["files"]
    llm = Llama(files["llama"], n_ctx=256, n_threads=1, seed=0, verbose=False,
                chat_format="chatml")  # fmt: skip
    return {"llm": llm, "files": files}


def run_case(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    from llamacrab.compat import Llama

    options = with_files(case["options"], state["files"])
    if case["where"] == "load":
        if "chat_handler" in options:
            options["chat_handler"] = _handler(options["chat_handler"], state["files"])
        keywords = {"n_ctx": 128, "n_threads": 1, "verbose": False, **options}
        with Llama(state["files"]["llama"], **keywords) as loaded:
            if loaded.model_params.vocab_only:
                return "ok", f"vocabulary alone; {_tokenizes_alone(loaded)}"
            result = loaded.create_completion("the cat", max_tokens=2, temperature=0)
            seen = _image_chat(loaded) if loaded.chat_handler is not None else ""
        return "ok", f"loaded; {result['usage']['completion_tokens']} tokens{seen}"
    llm = state["llm"]

    def answer() -> str:
        if case["where"] == "sample":
            return _eval_then_sample(llm, case)
        if case["where"] == "chat":
            keywords = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                        **options}  # fmt: skip
            result = llm.create_chat_completion(**keywords)
        else:
            result = llm.create_completion("the cat", **{"max_tokens": 3, **options})
        if not isinstance(result, dict):  # streamed (any true value of stream)
            return f"{len(list(result))} chunks"
        return f"{result['usage']['completion_tokens']} tokens"

    return then_still_answers(llm, answer, "values")


def _handler(value: Any, files: dict[str, str]) -> Any:
    """The chat handler a marker names, made as llama-cpp-python code makes it (its
    clip_model_path a file of the setup's where the marker names one); any other value as is."""
    if not (isinstance(value, dict) and "handler" in value):
        return value
    from llamacrab.compat import llama_chat_format

    clip = value["clip"]
    clip = files.get(clip, clip) if isinstance(clip, str) else clip
    keywords = {"use_gpu": value["use_gpu"]} if "use_gpu" in value else {}
    return getattr(llama_chat_format, value["handler"])(clip_model_path=clip, **keywords)


def _image_chat(llm: Any) -> str:
    """A chat with an image, as llama-cpp-python's handlers take one (a data URL)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    png = io.BytesIO()
    Image.fromarray(np.full((24, 32, 3), 120, np.uint8)).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "text", "text": "what is this?"},
               {"type": "image_url", "image_url": {"url": url}}]  # fmt: skip
    result = llm.create_chat_completion(messages=[{"role": "user", "content": content}],
                                        max_tokens=2, temperature=0)  # fmt: skip
    return f"; an image chat of {result['usage']['prompt_tokens']} prompt tokens"


def _tokenizes_alone(llm: Any) -> str:
    """A vocab_only Llama tokenizes, and refuses to run the model (ContextError)."""
    from llamacrab import ContextError

    tokens = llm.tokenize(b"the cat")
    assert llm.detokenize(tokens) == b"the cat" and llm.n_tokens == 0
    try:
        llm.create_completion("the cat", max_tokens=2)
    except ContextError:
        return f"{len(tokens)} tokens, completion refused"
    raise AssertionError("a vocab_only Llama completed")


def _eval_then_sample(llm: Any, case: dict[str, Any]) -> str:
    """llama-cpp-python's hand-written loop: reset, eval the tokens, maybe rewind
    ``n_tokens``, then a few samples each evaluated in turn."""
    llm.reset()
    llm.eval(case["tokens"])
    if case["rewind"] is not None:
        llm.n_tokens = case["rewind"]
    picked = []
    for _ in range(3):
        token = llm.sample(**case["options"])
        picked.append(token)
        llm.eval([token])
    return f"sampled {picked}"
