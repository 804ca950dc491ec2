"""NUMA placement (``init_numa``, llama-server's ``--numa``, llama-cpp-python's ``numa=``): once
per process, so every test runs in a child of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from support import REPO


def run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_one_placement_per_process_and_the_model_runs(tiny_model_path: Path) -> None:
    child = run_child("""
        import sys
        from llamacrab import InvalidParameterError, Llama, init_numa
        for strategy in ("nodes", "distribute", "distribute", "isolate"):
            try:
                init_numa(strategy)
                print(strategy, "ok")
            except InvalidParameterError as error:
                print(strategy, error)
        with Llama(sys.argv[1], n_ctx=64, n_threads=2) as llm:
            print(llm.create_completion("hello", max_tokens=3).usage.completion_tokens)
    """, str(tiny_model_path))  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.splitlines() == [
        "nodes NUMA strategy must be one of distribute, isolate, numactl, not 'nodes'",
        "distribute ok",
        "distribute ok",
        "isolate NUMA placement is 'distribute' for this process; llama.cpp sets it once",
        "3",
    ]


def test_llama_cpp_python_s_numa_keyword(tiny_model_path: Path) -> None:
    child = run_child("""
        import sys
        from llamacrab.compat import Llama, UnsupportedParameterError
        try:
            Llama(sys.argv[1], n_ctx=64, numa=4)  # ggml's mirror: not llama-server's
        except UnsupportedParameterError as error:
            print("refused:", error.reasons)
        for numa in (True, 1):  # True is 1, distribute; asked again, the same
            with Llama(sys.argv[1], n_ctx=64, numa=numa) as llm:
                answer = llm.llamacrab.create_completion("hi", max_tokens=2)
                print(numa, answer.usage.completion_tokens)
        try:
            Llama(sys.argv[1], n_ctx=64, numa=2)
        except ValueError as error:
            print("isolate:", error)
    """, str(tiny_model_path))  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    lines = child.stdout.splitlines()
    assert lines[0].startswith("refused: ('numa=4 (llamacrab places threads by distribute")
    assert lines[1:3] == ["True 2", "1 2"]
    assert lines[3] == "isolate: NUMA placement is 'distribute' for this process; llama.cpp " \
        "sets it once"  # fmt: skip


def test_the_server_flag_is_applied_before_the_model_loads(tiny_model_path: Path) -> None:
    command = [sys.executable, "-m", "llamacrab", "serve", str(tiny_model_path), "--port", "1",
               "--numa", "everywhere"]  # fmt: skip
    child = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert child.returncode == 1
    assert "NUMA strategy must be one of distribute, isolate, numactl" in child.stderr
