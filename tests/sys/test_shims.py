"""C++ exceptions thrown inside llama.cpp reach Python as codes and messages, never as a crash."""

from __future__ import annotations

from typing import Any

import pytest

from llamacrab_sys import ffi, lib, set_log_handler

from raw import ShimError, checked


def tokenize(vocab: Any, text: str) -> list[int]:
    data = text.encode()
    tokens = ffi.new("llama_token[]", len(data) + 8)
    n = checked(lib.safe_llama_tokenize, vocab, data, len(data), tokens, len(tokens), False, False)
    return list(tokens[0:n])


def test_out_of_range_token_is_an_exception_not_a_crash(tiny_model: Any) -> None:
    vocab = lib.llama_model_get_vocab(tiny_model)
    buf = ffi.new("char[]", 64)
    with pytest.raises(ShimError) as info:
        checked(lib.safe_llama_token_to_piece, vocab, 10_000_000, buf, len(buf), 0, False)
    assert info.value.code == lib.LLAMACRAB_STD_EXCEPTION
    assert info.value.message  # std::out_of_range's what()
    with pytest.raises(ShimError):
        checked(lib.safe_llama_vocab_get_text, vocab, -5)
    # The vocabulary is still usable afterwards.
    assert tokenize(vocab, "hello world") != []


def test_grammar_rejecting_an_accepted_token_throws_through_the_shim(tiny_model: Any) -> None:
    vocab = lib.llama_model_get_vocab(tiny_model)
    grammar = checked(lib.safe_llama_sampler_init_grammar, vocab, b'root ::= "cat"', b"root")
    assert grammar != ffi.NULL
    try:
        dog = tokenize(vocab, " dog")[-1]
        with pytest.raises(ShimError) as info:
            checked(lib.safe_llama_sampler_accept, grammar, dog)
        assert "grammar" in info.value.message
    finally:
        lib.llama_sampler_free(grammar)


def test_invalid_grammar_is_reported_and_returns_null(tiny_model: Any) -> None:
    lines: list[str] = []
    set_log_handler(lambda level, text: lines.append(text))
    try:
        vocab = lib.llama_model_get_vocab(tiny_model)
        grammar = checked(lib.safe_llama_sampler_init_grammar, vocab, b"root ::= (", b"root")
    finally:
        set_log_handler(None)
    assert grammar == ffi.NULL
    assert any("parse" in line for line in lines)


def test_corrupt_state_blob_is_rejected_and_context_survives(tiny_context: Any) -> None:
    garbage = b"\x01\x02not a llama.cpp state" * 8
    read = checked(lib.safe_llama_state_set_data, tiny_context, garbage, len(garbage))
    assert read == 0
    tokens = ffi.new("llama_token[]", [1, 260, 261])
    assert checked(lib.safe_llama_decode, tiny_context, lib.llama_batch_get_one(tokens, 3)) == 0


def test_unknown_chat_template_name_is_an_error_code() -> None:
    msg = ffi.new("struct llama_chat_message *")
    role, content = ffi.new("char[]", b"user"), ffi.new("char[]", b"hi")
    msg.role, msg.content = role, content
    buf = ffi.new("char[]", 256)
    result = checked(
        lib.safe_llama_chat_apply_template, b"no-such-template", msg, 1, True, buf, 256
    )
    assert result < 0
