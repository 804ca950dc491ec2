"""The examples run as documented against the default model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("completion.py", "greedy:  ' France"),
        ("streaming.py", " two, three, four, five"),
        ("prompt_cache.py", "603/610 prompt tokens reused"),
        ("chat.py", 'tool call: get_weather {"city": "Lisbon"}'),
        ("parallel.py", "finish: cancelled"),
        ("server.py", "completion: ' France"),
        ("multimodal.py", "image prompt: 31 tokens (16 from the image)"),
        ("models.py", "after loading embed: chat unloaded, embed loaded"),
        ("processes.py", "forked child, parent's Llama: refused: ForkedHandleError"),
        ("quantize.py", "Q8_0   278.0 MiB  greedy: ' France"),
        ("evaluate.py", "most likely: ' Paris'"),
        ("classify.py", "   sports  (sports "),
        (
            "grammar.py",
            "json: {'name': 'crab', 'legs': 10}\nlazy: ' Crab is a type of arachnids. "
            "ANSWER: 8\\n' eos",
        ),
    ],
)
def test_example_runs(script: str, expected: str, tmp_path: Path) -> None:
    command = [sys.executable, str(REPO / "examples" / script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert expected in result.stdout


def test_embeddings_example_ranks_the_right_document_first(tmp_path: Path) -> None:
    command = [sys.executable, str(REPO / "examples" / "embeddings.py")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[0].endswith("Paris is the capital of France.")
