"""``python -m reliability_kit.draw NAME MODE WORKDIR SEED OUT.json``: a section's cases and the
setup its children get, drawn in a process of their own.

Hypothesis's draws for a seed depend on what the drawing process imported and drew before
(schemathesis, another section's cases): drawn in a fresh process each time, a section's cases
are the same in a run of every section, a run of one and a replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    from reliability_kit.sections import SECTIONS, prepare

    name, mode, workdir, seed, out = sys.argv[1:]
    section = SECTIONS[name]
    cases, setup = prepare(name, section.short if mode == "short" else section.long,
                           Path(workdir), int(seed))  # fmt: skip
    Path(out).write_text(json.dumps({"cases": cases, "setup": setup}))


if __name__ == "__main__":
    main()
