"""The examples run as documented against the default model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support import REPO

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize(
    ("script", "expected"),
    [("completion.py", "greedy:  ' France"), ("streaming.py", " two, three, four, five")],
)
def test_example_runs(script: str, expected: str) -> None:
    command = [sys.executable, str(REPO / "examples" / script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert expected in result.stdout
