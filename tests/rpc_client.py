"""A client of ggml RPC workers, run by tests/test_rpc.py in a child process: ggml aborts the
process running a model whose worker dies, and the test must outlive that.

    python tests/rpc_client.py generate MODEL PROMPT N ENDPOINT[,ENDPOINT...]
        greedy tokens of a local run, of a run offloaded to the workers and of one sampled in
        their graph, as JSON
    python tests/rpc_client.py load MODEL ENDPOINT[,...]
        load with the workers; print the error class and message if it fails
    python tests/rpc_client.py two MODEL ENDPOINT[,...]
        two models on the same workers at once, then another one
    python tests/rpc_client.py die MODEL PROMPT ENDPOINT[,...]
        stream; after the first token print "streaming" and wait for a line on stdin (the test
        kills a worker meanwhile), then go on
"""

from __future__ import annotations

import json
import sys

from llamacrab import Llama, LlamaError


def generate(model: str, prompt: str, n: int, servers: str) -> None:
    result: dict[str, object] = {}
    # Workers hold weights in plain CPU buffers: locally too, for the same kernels.
    local = {"use_extra_bufts": False}
    extra: dict[str, object]
    for name, extra in (("local", local), ("rpc", {"rpc_servers": servers})):
        with Llama(model, n_ctx=256, n_threads=1, seed=1, **extra) as llm:
            out = llm.create_completion(prompt, max_tokens=n, temperature=0.0, logprobs=2)
            choice = out.choices[0]
            assert choice.logprobs is not None
            top = [sorted(t.values(), reverse=True)[:2] for t in choice.logprobs.top_logprobs]
            result[name] = {"tokens": list(choice.tokens), "text": choice.text, "top": top,
                            "auto": llm.context.graph_sampling}  # fmt: skip
    # The same greedy run sampled inside the workers' graph (no logprobs: nothing needs the
    # raw logits on this side).
    with Llama(model, n_ctx=256, n_threads=1, rpc_servers=servers, graph_sampling="on") as llm:
        out = llm.create_completion(prompt, max_tokens=n, temperature=0.0)
        result["rpc in graph"] = {"tokens": list(out.choices[0].tokens)}
    print(json.dumps(result))


def load(model: str, servers: str) -> None:
    try:
        with Llama(model, n_ctx=128, rpc_servers=servers, rpc_timeout=2.0):
            print("loaded")
    except LlamaError as error:
        print(f"{type(error).__name__}: {error}")


def two(model: str, servers: str) -> None:
    """Two models on the same workers at once (ggml shares the connection), then a third."""
    with (
        Llama(model, n_ctx=128, rpc_servers=servers) as first,
        Llama(model, n_ctx=128, rpc_servers=servers) as second,
    ):
        a = first.create_completion("hello", max_tokens=4, temperature=0).choices[0].tokens
        b = second.create_completion("hello", max_tokens=4, temperature=0).choices[0].tokens
        print("same" if a == b else f"differ {a} {b}")
    with Llama(model, n_ctx=128, rpc_servers=servers) as third:
        third.create_completion("hello", max_tokens=2)
    print("done")


def die(model: str, prompt: str, servers: str) -> None:
    with Llama(model, n_ctx=256, n_threads=1, rpc_servers=servers) as llm:
        for i, chunk in enumerate(llm.stream_completion(prompt, max_tokens=64, temperature=0.0)):
            if i == 0:
                print("streaming", flush=True)
                sys.stdin.readline()
            print(repr(chunk.text), flush=True)
    print("finished", flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "generate":
        generate(args[0], args[1], int(args[2]), args[3])
    elif command == "load":
        load(args[0], args[1])
    elif command == "two":
        two(args[0], args[1])
    else:
        die(args[0], args[1], args[2])
