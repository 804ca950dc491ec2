"""Log, progress and abort callbacks reach Python through the extern "Python" trampolines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llamacrab_sys import abort_callback, ffi, lib, progress_callback, set_log_handler

from raw import checked


def load_with_progress(path: Path, callback: Any) -> Any:
    params = lib.llama_model_default_params()
    handle = progress_callback(callback)
    params.progress_callback = handle.function
    params.progress_callback_user_data = handle.user_data
    return checked(lib.safe_llama_model_load_from_file, str(path).encode(), params)


def test_log_handler_receives_llama_cpp_messages(tiny_model_path: Path) -> None:
    lines: list[tuple[int, str]] = []
    set_log_handler(lambda level, text: lines.append((level, text)))
    try:
        model = load_with_progress(tiny_model_path, lambda fraction: True)
        lib.llama_model_free(model)
    finally:
        set_log_handler(None)
    assert any("llamacrab-tiny-llama" in text for _, text in lines)
    assert {level for level, _ in lines} <= {
        lib.GGML_LOG_LEVEL_NONE, lib.GGML_LOG_LEVEL_DEBUG, lib.GGML_LOG_LEVEL_INFO,
        lib.GGML_LOG_LEVEL_WARN, lib.GGML_LOG_LEVEL_ERROR, lib.GGML_LOG_LEVEL_CONT,
    }  # fmt: skip


def test_progress_callback_reports_and_can_cancel(tiny_model_path: Path) -> None:
    seen: list[float] = []
    model = load_with_progress(tiny_model_path, lambda fraction: seen.append(fraction) or True)
    assert model != ffi.NULL
    lib.llama_model_free(model)
    assert seen and seen[-1] == 1.0

    cancelled = load_with_progress(tiny_model_path, lambda fraction: False)
    assert cancelled == ffi.NULL


def test_abort_callback_stops_decoding(tiny_context: Any) -> None:
    calls: list[int] = []
    handle = abort_callback(lambda: calls.append(1) or True)
    lib.llama_set_abort_callback(tiny_context, handle.function, handle.user_data)
    try:
        tokens = ffi.new("llama_token[]", [1, 260, 261, 262])
        status = checked(lib.safe_llama_decode, tiny_context, lib.llama_batch_get_one(tokens, 4))
    finally:
        lib.llama_set_abort_callback(tiny_context, ffi.NULL, ffi.NULL)
    assert calls
    assert status == 2  # llama_decode: "aborted"
