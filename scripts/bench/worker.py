"""One benchmark task in a fresh process, for llamacrab or llama-cpp-python.

Usage: python worker.py {llamacrab|llama-cpp-python} TASK 'JSON arguments'
Prints one JSON line. The orchestrator (scripts/bench.py) runs it with each side's interpreter;
it imports only the side it measures, so it runs in llama-cpp-python's own virtual environment.

Tasks (same work on both sides):
  speed    prefill of a token prompt (tokens/s) and decode of n_gen tokens after it (greedy, or
           the ``sampling`` keywords given) through each library's streaming text-completion
           API, the ``banned`` tokens (end of generation) banned with its logit_bias, timed
           from the first chunk to the end of the stream
  startup  import time, model load time, time to the first streamed token of a text prompt,
           then 128 tokens, and the process's peak resident memory
  embed    texts/s embedding a list of texts in one call (after a warm-up call)
  context  prefill t/s at growing prompt sizes and decode t/s at growing context depths
           (llamacrab only; scripts/bench_growth.py)
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

GREEDY = {"temperature": 0}


class _Side:
    """What both sides run, through each library's streaming text completion (``stream``)."""

    llm: Any

    def stream(self, prompt: str | list[int], n_gen: int, **sampling: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def text(chunk: Any) -> str:
        raise NotImplementedError

    @staticmethod
    def finish_reason(chunk: Any) -> str | None:
        raise NotImplementedError

    def decode_seconds(
        self,
        prompt: list[int],
        n_gen: int,
        banned: list[int],
        fresh: bool = True,
        sampling: dict[str, Any] | None = None,
    ) -> float:
        """``fresh=False``: the prompt is in memory already (all but its last token reused);
        ``sampling``: the request's sampling keywords (None: greedy)."""
        if fresh:
            self.llm.reset()
        bias = dict.fromkeys(banned, float("-inf"))
        stream = self.stream(prompt, n_gen, logit_bias=bias, **(sampling or GREEDY))
        return _after_first(stream, self.finish_reason)

    def first_token_then_rest(self, text: str, n_gen: int) -> float:
        started = time.perf_counter()
        first = None
        for chunk in self.stream(text, n_gen, **GREEDY):
            if first is None and self.text(chunk):
                first = time.perf_counter() - started
        return first if first is not None else float("nan")

    def embed(self, texts: list[str]) -> None:
        self.llm.embed(texts)


class Llamacrab(_Side):
    @staticmethod
    def library() -> Any:
        import llamacrab

        return llamacrab

    def __init__(self, model: str, **options: Any) -> None:
        self.llm = self.library().Llama(model, **options)

    def prefill(self, prompt: list[int]) -> None:
        self.llm.reset()
        self.llm.create_completion(prompt, max_tokens=0)

    def stream(self, prompt: str | list[int], n_gen: int, **sampling: Any) -> Any:
        return self.llm.stream_completion(prompt, max_tokens=n_gen, **sampling)

    @staticmethod
    def text(chunk: Any) -> str:
        return chunk.text  # type: ignore[no-any-return]

    @staticmethod
    def finish_reason(chunk: Any) -> str | None:
        return chunk.finish_reason  # type: ignore[no-any-return]


class LlamaCppPython(_Side):
    @staticmethod
    def library() -> Any:
        import llama_cpp

        return llama_cpp

    def __init__(self, model: str, **options: Any) -> None:
        renamed = {"embedding" if k == "embeddings" else k: v for k, v in options.items()}
        # Its default turns flash attention off; llama.cpp's "auto" (native's and llamacrab's
        # default) turns it on for these models on the CPU: the same kernels on every side.
        self.llm = self.library().Llama(model, verbose=False, flash_attn=True, **renamed)

    def prefill(self, prompt: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(prompt)

    def stream(self, prompt: str | list[int], n_gen: int, **sampling: Any) -> Any:
        return self.llm.create_completion(prompt, max_tokens=n_gen, stream=True, **sampling)

    @staticmethod
    def text(chunk: Any) -> str:
        return chunk["choices"][0]["text"]  # type: ignore[no-any-return]

    @staticmethod
    def finish_reason(chunk: Any) -> str | None:
        return chunk["choices"][0]["finish_reason"]  # type: ignore[no-any-return]


SIDES = {"llamacrab": Llamacrab, "llama-cpp-python": LlamaCppPython}


def _after_first(stream: Any, finish_reason: Any) -> float:
    """Seconds from the first chunk to the end of a stream that must end at max_tokens."""
    first, reason = None, None
    for chunk in stream:
        first = first or time.perf_counter()
        reason = finish_reason(chunk) or reason
    assert first is not None and reason == "length", f"the stream ended with {reason}"
    return time.perf_counter() - first


def speed(
    side: type,
    model: str,
    threads: int,
    prompt: list[int],
    n_gen: int,
    banned: list[int],
    sampling: dict[str, Any] | None = None,
    **options: Any,
) -> dict[str, float]:
    """``sampling``: the decode's sampling keywords (None: greedy); ``options``: more keywords
    for the engine (llamacrab's graph_sampling)."""
    n_prompt = len(prompt)
    engine = side(model, n_ctx=n_prompt + n_gen + 16, n_batch=n_prompt, n_ubatch=n_prompt,
                  n_threads=threads, n_threads_batch=threads, **options)  # fmt: skip
    engine.prefill(prompt)  # warm-up
    started = time.perf_counter()
    engine.prefill(prompt)
    prefill = time.perf_counter() - started
    # After the first token's chunk: n_gen - 1 more samples and decodes.
    return {
        "pp": n_prompt / prefill,
        "tg": (n_gen - 1) / engine.decode_seconds(prompt, n_gen, banned, sampling=sampling),
    }


def startup(side: type, model: str, threads: int, text: str) -> dict[str, float]:
    started = time.perf_counter()
    side.library()
    imported = time.perf_counter() - started
    started = time.perf_counter()
    # The context of the native loop's run: 512 prompt + 128 generated tokens, 512 per batch.
    engine = side(model, n_ctx=512 + 128 + 16, n_batch=512, n_ubatch=512, n_threads=threads,
                  n_threads_batch=threads)  # fmt: skip
    load = time.perf_counter() - started
    ttft = engine.first_token_then_rest(text, 128)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"import_s": imported, "load_s": load, "ttft_s": ttft, "peak_rss_mib": peak_kib / 1024}


def embed(side: type, model: str, threads: int, texts: list[str]) -> dict[str, float]:
    engine = side(model, embeddings=True, n_ctx=512, n_threads=threads, n_threads_batch=threads)
    engine.embed(texts[:8])
    started = time.perf_counter()
    engine.embed(texts)
    return {"texts_per_s": len(texts) / (time.perf_counter() - started)}


def context(
    side: type,
    model: str,
    threads: int,
    prefill: list[int],
    depths: list[int],
    n_gen: int,
    banned: list[int],
    bos: int,
    n_vocab: int,
) -> dict[str, dict[int, float]]:
    """Prefill t/s at each size of ``prefill``, and decode t/s of n_gen - 1 tokens at each
    context depth of ``depths`` (after that prefill: nothing decoded twice), in one model with
    llama.cpp's default batch sizes; the bench.py synthetic prompt, as long as needed."""
    longest = max(512, *prefill, *depths)  # the warm-up's 512 tokens at least
    engine = side(model, n_ctx=longest + n_gen + 64, n_threads=threads, n_threads_batch=threads)
    tokens = [bos] + [3 + (1000 + i) % (n_vocab - 3) for i in range(1, longest)]
    engine.prefill(tokens[:512])  # warm-up
    result: dict[str, dict[int, float]] = {"prefill": {}, "decode": {}}
    for size in sorted({*prefill, *depths}):
        prompt = tokens[: max(size, 1)]
        started = time.perf_counter()
        engine.prefill(prompt)
        seconds = time.perf_counter() - started
        if size in prefill:
            result["prefill"][size] = size / seconds
        if size in depths:
            elapsed = engine.decode_seconds(prompt, n_gen, banned, fresh=False)
            result["decode"][size] = (n_gen - 1) / elapsed
    return result


TASKS = {"speed": speed, "startup": startup, "embed": embed, "context": context}


def main() -> None:
    side, task, arguments = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    print(json.dumps(TASKS[task](SIDES[side], **arguments)))


if __name__ == "__main__":
    main()
