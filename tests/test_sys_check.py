"""The import-time check of the installed llamacrab-sys (llamacrab._native.sys_check)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import llamacrab
from llamacrab._native import sys_check
from llamacrab._native.sys_check import SUPPORTED_LLAMA_CPP_COMMITS, check_sys

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PIN = json.loads((ROOT / "llamacrab-sys" / "pin.json").read_text())["llama_cpp_commit"]


def test_the_pinned_commit_is_supported() -> None:
    # The bump workflow changes pin.json; this fails until llamacrab lists the new commit.
    assert PIN in SUPPORTED_LLAMA_CPP_COMMITS


def test_the_check_agrees_with_the_declared_requirement() -> None:
    project = tomllib.loads((ROOT / "llamacrab" / "pyproject.toml").read_text())["project"]
    (spec,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "llamacrab-sys"]
    major, minor = sys_check.SYS_SERIES
    inside = [f"{major}.{minor}.0", f"{major}.{minor}.7", f"{major}.{minor}.0+cu130"]
    outside = [f"{major}.{minor + 1}.0", f"{major + 1}.{minor}.0", f"{major}.{minor - 1}.9"]
    for version in inside:
        assert spec.specifier.contains(version), version
        check_sys(version, PIN)
    for version in outside:
        assert not spec.specifier.contains(version), version
        with pytest.raises(llamacrab.SysVersionError):
            check_sys(version, PIN)


def test_installed_pair_passes() -> None:
    sys_check.check_installed()


def test_unsupported_version_names_both() -> None:
    with pytest.raises(llamacrab.SysVersionError) as info:
        check_sys("0.2.0", PIN)
    assert "llamacrab-sys 0.2.0 is installed" in str(info.value)
    assert "needs llamacrab-sys 0.1.x" in str(info.value)
    assert isinstance(info.value, ImportError)
    with pytest.raises(llamacrab.SysVersionError, match="llamacrab-sys garbage is installed"):
        check_sys("garbage", PIN)


def test_unsupported_commit_names_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(sys_check.ALLOW_ANY_COMMIT_ENV, raising=False)
    with pytest.raises(llamacrab.SysVersionError) as info:
        check_sys("0.1.0", "f" * 40)
    assert f"llama.cpp {'f' * 12}" in str(info.value)
    assert f"supports llama.cpp {PIN[:12]}" in str(info.value)


def test_opt_out_warns_instead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(sys_check.ALLOW_ANY_COMMIT_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="llamacrab"):
        check_sys("0.1.0", "f" * 40)
    assert "built from llama.cpp ffffffffffff" in caplog.text
    # The opt-out covers the commit only: another version series stays an error.
    with pytest.raises(llamacrab.SysVersionError):
        check_sys("0.2.0", "f" * 40)


def test_own_llama_cpp_warns_instead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(sys_check.ALLOW_ANY_COMMIT_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="llamacrab"):
        check_sys("0.1.0", "e" * 40, own_llama_cpp=True)
    assert "continuing with your own llama.cpp build" in caplog.text
    with pytest.raises(llamacrab.SysVersionError):
        check_sys("0.3.0", "e" * 40, own_llama_cpp=True)


# The child patches what llamacrab_sys reports, then imports llamacrab for the first time.
_CHILD = """
import dataclasses, pathlib, sys
import llamacrab_sys
if sys.argv[1] == "version":
    llamacrab_sys.__version__ = "0.9.3"
else:
    real = llamacrab_sys.build_info()
    own = {"llama_cpp_prefix": pathlib.Path("/opt/llama.cpp")} if sys.argv[1] == "own" else {}
    patched = dataclasses.replace(real, llama_cpp_commit="ab" * 20, **own)
    llamacrab_sys.build_info = lambda: patched
try:
    import llamacrab
except ImportError as exc:
    print(type(exc).__name__, exc)
else:
    print("imported")
"""


@pytest.mark.parametrize(
    ("what", "expected"),
    [
        ("version", "llamacrab-sys 0.9.3 is installed"),
        ("commit", "built from llama.cpp abababababab, but llamacrab supports llama.cpp"),
        # Built against the user's own llama.cpp: the untested commit is only logged.
        ("own", "imported"),
    ],
)
def test_import_fails_with_unsupported_sys(what: str, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != sys_check.ALLOW_ANY_COMMIT_ENV}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, what],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    ).stdout
    assert out.startswith("imported" if what == "own" else "SysVersionError "), out
    assert expected in out
