"""A stand-in section for tests/test_reliability.py: each case reports the heap byte its child
runs with (``"differs"``) or a constant, as a graph reading memory nothing wrote would or
would not show it."""

from __future__ import annotations

import os
from typing import Any


def setup(config: dict[str, Any], slot: int) -> dict[str, Any]:
    return {}


def run_case(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    if case.get("differs"):
        return "ok", f"computed {os.environ.get('MALLOC_PERTURB_')}"
    return "ok", "computed the same"
