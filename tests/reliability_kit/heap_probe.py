"""A stand-in section for tests/test_reliability.py: each case reports the heap byte its child
runs with (``"differs"``) or a constant, as a graph reading memory nothing wrote would or
would not show it; or (``"sanitizer"``) ends its child as a sanitizer does after a report."""

from __future__ import annotations

import os
import sys
from typing import Any

# How each sanitizer's report on a stop ends, shortened.
REPORTS = {
    "address": "==1==ERROR: AddressSanitizer: heap-buffer-overflow on address 0x1\n"
    "SUMMARY: AddressSanitizer: heap-buffer-overflow probe.c:7 in read\n"
    "Shadow bytes around the buggy address:\n  0x1: fa fa\n==1==ABORTING\n",
    "undefined": "probe.c:9:5: runtime error: load of value 7, which is not a valid value for "
    "type 'kind'\n    #0 0x1 in read probe.c:9\n    #1 0x2 in main probe.c:12\n",
}


def setup(config: dict[str, Any], slot: int) -> dict[str, Any]:
    return {}


def run_case(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    if case.get("sanitizer"):
        sys.stderr.write(REPORTS[case["sanitizer"]])
        sys.stderr.flush()
        os._exit(99)  # scripts/sanitizer_env.sh's exit status for a sanitizer's stop
    if case.get("differs"):
        return "ok", f"computed {os.environ.get('MALLOC_PERTURB_')}"
    return "ok", "computed the same"
