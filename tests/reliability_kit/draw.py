"""A section's cases and the setup its children get, drawn in a process of their own:
``drawn(...)`` runs ``python -m reliability_kit.draw NAME MODE WORKDIR SEED OUT.json``.

Hypothesis's draws for a seed depend on what the drawing process imported and drew before
(schemathesis, another section's cases): drawn in a fresh process each time, a section's cases
are the same in a run of every section, a run of one and a replay."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from reliability_kit.children import REPO, kit_environment


def drawn(name: str, mode: str, workdir: Path, seed: int) -> tuple[list[Any], dict[str, Any]]:
    """``sections.prepare``'s cases and setup for section ``name``, drawn in a fresh process."""
    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workdir) as scratch:
        out = Path(scratch) / "drawn.json"
        subprocess.run(
            [sys.executable, "-m", "reliability_kit.draw", name, mode, str(workdir), str(seed),
             str(out)], check=True, env=kit_environment(), cwd=REPO, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        result = json.loads(out.read_text())
    return result["cases"], result["setup"]


def main() -> None:
    from reliability_kit.sections import SECTIONS, prepare

    name, mode, workdir, seed, out = sys.argv[1:]
    cases, setup = prepare(name, SECTIONS[name].size(mode), Path(workdir), int(seed))
    Path(out).write_text(json.dumps({"cases": cases, "setup": setup}))


if __name__ == "__main__":
    main()
