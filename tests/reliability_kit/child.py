"""The child's side of ``children.Runner``: ``python -m reliability_kit.child JOB.json``.

Runs each case of the job with the section's ``run_case`` and writes one JSON line per case to
the file descriptor in RELIABILITY_FD. A LlamaError escaping a case is its ``error`` outcome
(the expected refusal); any other exception is ``unclean``. A section may report ``hang`` for
a case whose thread never finished: the child then leaves at once (``os._exit``), since that
thread may hold locks the next case needs, and the parent goes on in a new child.

Run by hand (a crash's job file is kept), it prints the reports instead.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import resource
import sys
import time
import traceback
from typing import Any, TextIO

HANG_DUMP = 5.0  # seconds before a case's time limit


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:500]


def limit_address_space(limit: int) -> None:
    """RLIMIT_AS, except in a build with AddressSanitizer, which reserved terabytes of address
    space for its shadow memory as the process started: any limit would fail its next mapping."""
    from llamacrab_sys import build_info

    if "address" not in build_info().sanitize.split(","):
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> None:
    faulthandler.enable()  # a signal death leaves its Python stack in the log
    with open(sys.argv[1]) as file:
        job = json.load(file)
    fd = os.environ.get("RELIABILITY_FD")
    out: TextIO = os.fdopen(int(fd), "w") if fd else sys.stdout
    if job.get("memory_limit"):
        limit_address_space(int(job["memory_limit"]))

    def emit(report: dict[str, Any]) -> None:
        out.write(json.dumps(report) + "\n")
        out.flush()

    from llamacrab import LlamaError

    section = importlib.import_module(f"reliability_kit.{job['module']}")
    state = section.setup(job["setup"], job["slot"])
    emit({"ready": True})
    # A case still running this long before the runner kills it as a hang leaves the Python
    # stack of every thread in the log: where it is stuck (fd 2 itself: a section may wrap
    # sys.stderr).
    dump_after = max(job.get("case_timeout", 60.0) - HANG_DUMP, 1.0)
    for case in job["cases"]:
        started = time.monotonic()
        faulthandler.dump_traceback_later(dump_after, file=sys.__stderr__)
        try:
            outcome, detail = section.run_case(case, state)
        except LlamaError as error:
            outcome, detail = "error", describe(error)
        except Exception as error:
            outcome = "unclean"
            detail = describe(error) + "\n" + "".join(traceback.format_exc(limit=-6))[-1500:]
        faulthandler.cancel_dump_traceback_later()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        emit({"id": case["id"], "outcome": outcome, "detail": detail,
              "seconds": round(time.monotonic() - started, 4), "peak_rss_kib": rss})  # fmt: skip
        if outcome == "hang":
            emit({"abandon": True})
            os._exit(0)
    emit({"done": True, "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
    # Leaving normally is part of the test: live handles are closed by the exit hooks.


if __name__ == "__main__":
    main()
