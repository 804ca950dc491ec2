"""An abort inside ggml ends the process at once: it never hangs trying to print a backtrace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    from llamacrab._native import backend
    from llamacrab_sys import lib
    backend.ensure_initialised()
    ctx = lib.gguf_init_empty()
    lib.gguf_set_val_str(ctx, b"key", b"a string")
    lib.gguf_get_val_u32(ctx, 0)  # GGML_ASSERT: the value is not a u32 -> abort()
    print("unreachable")
""")


def test_ggml_assert_aborts_promptly_without_a_debugger() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GGML_NO_BACKTRACE"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == -signal.SIGABRT
    assert "GGML_ASSERT" in result.stderr and "unreachable" not in result.stdout
