"""The llamacrab command line: run (one-shot and chat), info, tokenize, serve --help."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llamacrab import Llama
from llamacrab.cli import main


def llamacrab(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "llamacrab", *args]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=300)


def test_info_reports_the_build_and_the_model(
    tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", str(tiny_model_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "cpu" and len(report["llama.cpp commit"]) == 40
    assert report["model"]["architecture"] == "llama"
    assert main(["info", "--build-only"]) == 0
    assert "model" not in json.loads(capsys.readouterr().out)


def test_tokenize_prints_ids_and_pieces(
    tiny_llama: Llama, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tokenize", str(tiny_model_path), "the cat"]) == 0
    ids = [int(t) for t in capsys.readouterr().out.split()]
    assert ids == tiny_llama.tokenize("the cat")
    assert main(["tokenize", str(tiny_model_path), "the cat", "--pieces", "--no-special"]) == 0
    lines = capsys.readouterr().out.splitlines()
    pieces = [json.loads(line.split(" ", 1)[1]) for line in lines]
    tokens = tiny_llama.tokenize("the cat", add_special=False)
    assert pieces == [tiny_llama.vocab.token_to_piece(t, special=True) for t in tokens]


def test_errors_are_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenize", str(tmp_path / "missing.gguf"), "x"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("llamacrab: ") and error.count("\n") == 1


def test_text_arguments_that_are_not_utf8_are_named(
    tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A byte that is not UTF-8 on the command line (b"\xff") reaches Python as "\udcff": the
    # error spoke of "an unpaired surrogate '\udcff'" instead of the argument.
    model = str(tiny_model_path)
    for argv, named in (
        (["run", model, "-p", "a\udcff"], "-p/--prompt is not valid UTF-8 (at character 1)"),
        (
            ["run", model, "-p", "a", "--stop", "\udcff"],
            "--stop is not valid UTF-8 (at character 0)",
        ),
        (["tokenize", model, "\udcff"], "the text to tokenize is not valid UTF-8 (at character 0)"),
    ):
        assert main(argv) == 1
        assert capsys.readouterr().err == f"llamacrab: {named}: give it in UTF-8\n"


@pytest.mark.real_model
def test_run_defaults_to_gemma_for_a_prompt_and_for_a_chat() -> None:
    one_shot = llamacrab("run", "-p", "Paris is the capital of", "-n", "3", "--temperature", "0")
    assert one_shot.returncode == 0, one_shot.stderr[-2000:]
    assert one_shot.stdout.startswith(" France")
    chat = llamacrab("run", "-n", "4", "--temperature", "0", stdin="Hello!\nThanks.\n\n")
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert chat.stdout.count("> ") == 3  # two turns answered, then the empty line ends it


def test_every_command_has_help() -> None:
    for command in ("run", "serve", "info", "tokenize"):
        result = llamacrab(command, "--help")
        assert result.returncode == 0 and "usage: llamacrab" in result.stdout
    assert "LLAMACRAB_API_KEY" in llamacrab("serve", "--help").stdout


def test_a_reader_that_leaves_and_a_missing_stdin_end_quietly(tiny_model_path: Path) -> None:
    # `| head -c 10` raised BrokenPipeError with a traceback; >/dev/full an OSError one;
    # chat with stdin closed (<&-) RuntimeError("input(): lost sys.stdin") (a hunt).
    command = [sys.executable, "-m", "llamacrab", "run", str(tiny_model_path), "-p", "hi",
               "-n", "2000"]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        assert child.stdout is not None and child.stderr is not None
        # The reader leaves before the answer comes (while the model loads): the tiny model's
        # whole answer fits in a pipe's buffer, so a reader leaving after its first bytes let
        # the child finish writing first now and then (exit 0, a flaky test).
        child.stdout.close()
        errors = child.stderr.read().decode()
        assert child.wait(timeout=300) == 1
    assert "Traceback" not in errors, errors
    with open("/dev/full", "w") as full:
        child_full = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True,
                                    timeout=300)  # fmt: skip
    assert child_full.returncode == 1 and "Traceback" not in child_full.stderr
    assert "No space left on device" in child_full.stderr
    closed_stdin = 'exec "$0" -m llamacrab run "$1" <&-'
    chat = subprocess.run(["sh", "-c", closed_stdin, sys.executable, str(tiny_model_path)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert chat.returncode == 0 and "Traceback" not in chat.stderr, chat.stderr


def test_text_to_a_file_or_pipe_is_utf8_whatever_the_locale(tiny_model_path: Path) -> None:
    """Python writes a redirected stdout in the locale's encoding (cp1252 on Windows): the
    tiny model's U+FFFD raised UnicodeEncodeError mid-answer. Redirected text is UTF-8."""
    command = [sys.executable, "-m", "llamacrab", "run", str(tiny_model_path), "-p", "hi",
               "-n", "64", "--temperature", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONIOENCODING": "cp1252"}
    run = subprocess.run(command, capture_output=True, env=env, timeout=300)
    assert run.returncode == 0 and b"Traceback" not in run.stderr, run.stderr.decode()
    with Llama(tiny_model_path, n_ctx=256) as llm:
        expected = llm.create_completion("hi", max_tokens=64, temperature=0).text
    assert "\ufffd" in expected  # what cp1252 cannot write
    assert run.stdout.decode("utf-8").strip() == expected.strip()


def test_serve_exits_saying_why_when_its_model_fails_to_load(tmp_path: Path) -> None:
    # Found by an audit: `serve typo.gguf` ran on printing nothing but uvicorn's lines (the
    # library's logger is quiet unless configured; a program configures it). Then a red team:
    # it ran on answering 503 for ever, where llama-server exits; a service manager saw it up.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    missing = tmp_path / "typo.gguf"
    command = [sys.executable, "-m", "llamacrab", "serve", str(missing), "--port", str(port)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    logged = [line for line in run.stderr.splitlines() if "failed to load" in line]
    assert logged[0].startswith("ERROR:") and f"model file not found: {missing}" in logged[0]
    assert run.stderr.splitlines()[-1] == (
        f"llamacrab: the model failed to load: ModelLoadError: model file not found: {missing}"
    )
    assert "Traceback" not in run.stderr
