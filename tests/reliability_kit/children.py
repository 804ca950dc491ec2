"""Cases run in child processes, many per child, so that a signal death or a hang is caught and
pinned on one case.

A child (``python -m reliability_kit.child JOB``) runs its cases in order and reports each on a
pipe of its own as it finishes. The parent waits for each report with the case's time limit: no
report in time is a hang (the child is killed), the pipe ending early is a death. The case in
flight is then rerun alone in a fresh child: if it fails alone it is the culprit; if not, the
cases that ran before it in the same child are rerun alone one by one, and the first that fails
is. One death or hang counts once, on its culprit. The remaining cases go on in a new child.

Outcomes of a case: ``ok`` (it worked), ``error`` (a LlamaError subclass, the expected refusal),
``unclean`` (any other exception escaped the library), ``crash`` (the process died: a signal, or
an exit status without a report) and ``hang`` (past its time limit).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llamacrab._exit_status import describe

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
FAILURES = ("unclean", "crash", "hang")


# The heap bytes of the children of a section that runs its cases twice (Section.again_with);
# the synthesizer's processes use the other one (a model's fingerprint, synthesized.py).
HEAP_BYTE, OTHER_HEAP_BYTE = 0xA5, 0x5A


def kit_environment() -> dict[str, str]:
    """This process's environment, with the kit and the scripts importable: a child's."""
    path = os.pathsep.join([str(TESTS), str(REPO / "scripts"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def poisoned_heap(byte: int) -> dict[str, str]:
    """Environment in which glibc fills each block malloc hands out from its heap with
    ``byte`` ^ 0xff and each freed one with ``byte`` (a tiny model's buffers once the mmap
    threshold has grown past them; a lower fixed threshold costs twice the time): what a graph
    reads that nothing wrote then differs with ``byte``, so a case computes the same under two
    bytes only if it reads nothing of the kind."""
    return {"MALLOC_PERTURB_": str(byte)}


@dataclass
class Result:
    id: str
    outcome: str
    detail: str = ""
    seconds: float = 0.0
    peak_rss_kib: int = 0  # of its child, up to the end of this case


@dataclass
class Report:
    """What one section found: a result per case tried, and how the children fared."""

    section: str
    results: list[Result] = field(default_factory=list)
    wall_seconds: float = 0.0
    children: int = 0
    peak_rss_mib: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def count(self, outcome: str) -> int:
        return sum(1 for r in self.results if r.outcome == outcome)

    @property
    def counts(self) -> dict[str, int]:
        return {
            "cases": len(self.results),
            "worked": self.count("ok"),
            "refused": self.count("error"),
            "signal deaths": self.count("crash"),
            "hangs": self.count("hang"),
            "unclean errors": self.count("unclean"),
        }

    @property
    def findings(self) -> list[Result]:
        return [r for r in self.results if r.outcome in FAILURES]

    def error_types(self) -> Counter[str]:
        return Counter(r.detail.split(":", 1)[0] for r in self.results if r.outcome == "error")

    @property
    def slowest(self) -> Result | None:
        return max(self.results, key=lambda r: r.seconds, default=None)

    def summary(self) -> str:
        counts = ", ".join(f"{k} {v}" for k, v in self.counts.items())
        lines = [f"{self.section}: {counts}; {self.wall_seconds:.1f} s, {self.children} children, "
                 f"peak RSS {self.peak_rss_mib:.0f} MiB"]  # fmt: skip
        lines += [f"  {r.outcome} {r.id}: {r.detail[:2000]}" for r in self.findings]
        if self.findings and "replay" in self.extra:
            lines.append(f"  replay one case: {self.extra['replay']} ({self.extra['drawn_with']})")
        return "\n".join(lines)


@dataclass
class Runner:
    """Runs one section's cases (dicts with an ``id``) in batches of ``batch_size`` per child,
    ``workers`` children at a time. ``setup`` is handed to the section's ``setup`` in each
    child; ``case_timeout`` bounds one case, ``exit_timeout`` a child's exit after its last
    case, ``memory_limit`` (bytes) is each child's RLIMIT_AS. Cases with ``"exit": true``
    leave the interpreter with work in flight, so each runs alone. Batches not started by
    ``deadline`` (a ``time.monotonic()`` value) are skipped."""

    section: str
    module: str  # reliability_kit.<module> runs the cases in the child
    setup: dict[str, Any]
    workdir: Path
    batch_size: int = 50
    workers: int = 2
    case_timeout: float = 60.0
    setup_timeout: float = 120.0
    exit_timeout: float = 30.0
    memory_limit: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    deadline: float | None = None
    progress: Callable[[str], None] | None = None
    _children: int = 0
    _peak_rss_kib: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, cases: Sequence[dict[str, Any]]) -> Report:
        started = time.monotonic()
        together = [c for c in cases if not c.get("exit")]
        batches = [
            together[i : i + self.batch_size] for i in range(0, len(together), self.batch_size)
        ]
        batches += [[c] for c in cases if c.get("exit")]
        slots: queue.Queue[int] = queue.Queue()
        for slot in range(self.workers):
            slots.put(slot)

        def work(batch: list[dict[str, Any]]) -> list[Result]:
            if self.deadline is not None and time.monotonic() > self.deadline:
                return []
            slot = slots.get()
            try:
                results = self._run_batch(batch, slot)
            finally:
                slots.put(slot)
            if self.progress is not None:
                bad = sum(r.outcome in FAILURES for r in results)
                self.progress(f"{self.section}: {len(results)} cases, {bad} failures")
            return results

        with ThreadPoolExecutor(self.workers) as pool:
            merged = [r for results in pool.map(work, batches) for r in results]
        return Report(self.section, merged, time.monotonic() - started, self._children,
                      self._peak_rss_kib / 1024)  # fmt: skip

    # -- one batch -----------------------------------------------------------------------------

    def _run_batch(self, cases: list[dict[str, Any]], slot: int) -> list[Result]:
        results: dict[str, Result] = {}
        rest = cases
        while rest:
            done, failure = self._run_child(rest, slot)
            results.update((r.id, r) for r in done)
            if failure is None:
                # Ended early without failing: the child gave up on a stuck thread (reported
                # as a hang of its case); the rest goes on in a new child.
                rest = rest[len(done) :]
                continue
            index = len(done)
            culprit = self._isolate(rest, index, slot, failure)
            results[culprit.id] = culprit
            if index >= len(rest):  # died on its way out, after the last report
                break
            rest = rest[index + 1 :]
        return list(results.values())

    def _isolate(
        self, cases: list[dict[str, Any]], index: int, slot: int, failure: Result
    ) -> Result:
        """The case to blame for ``failure``: the one in flight if it fails alone, else the
        first case before it that does; failing that, the one in flight, marked unconfirmed."""
        if len(cases) == 1:
            return failure
        suspects = ([cases[index]] if index < len(cases) else []) + cases[:index][::-1]
        for case in suspects:
            _, failed = self._run_child([case], slot)
            if failed is not None:
                failed.detail += f" (confirmed alone; its batch: {[c['id'] for c in cases]})"
                return failed
        blamed = cases[min(index, len(cases) - 1)]["id"]
        return Result(blamed, failure.outcome,
                      f"{failure.detail} (not reproduced alone; its batch: "
                      f"{[c['id'] for c in cases[: index + 1]]})", failure.seconds)  # fmt: skip

    # -- one child -----------------------------------------------------------------------------

    def _run_child(
        self, cases: list[dict[str, Any]], slot: int
    ) -> tuple[list[Result], Result | None]:
        """Run ``cases`` in one child: the results reported, and the failure that ended it early
        (a crash or hang; ``id`` is the case in flight, or the last case for an exit)."""
        with self._lock:
            self._children += 1
        self.workdir.mkdir(parents=True, exist_ok=True)
        handle, job_path = tempfile.mkstemp(prefix=f"{self.section}-", suffix=".json",
                                            dir=self.workdir)  # fmt: skip
        with os.fdopen(handle, "w") as job_file:
            json.dump({"module": self.module, "setup": self.setup, "slot": slot,
                       "memory_limit": self.memory_limit, "case_timeout": self.case_timeout,
                       "cases": cases}, job_file)  # fmt: skip
        log_path = Path(job_path).with_suffix(".log")
        read_end, write_end = os.pipe()
        env = {**kit_environment(), **self.env, "GGML_NO_BACKTRACE": "1",
               "RELIABILITY_FD": str(write_end)}  # fmt: skip
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "reliability_kit.child", job_path],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                pass_fds=(write_end,), start_new_session=True, cwd=REPO,
            )  # fmt: skip
        os.close(write_end)
        reports: queue.Queue[dict[str, Any] | None] = queue.Queue()
        reader = threading.Thread(target=_read_reports, args=(read_end, reports), daemon=True)
        reader.start()
        results: list[Result] = []
        failure: Result | None = None
        timeout = self.setup_timeout + self.case_timeout
        case_started = time.monotonic()
        abandoned = ready = False
        while True:
            in_flight = cases[len(results)]["id"] if len(results) < len(cases) else None
            try:
                report = reports.get(timeout=timeout)
            except queue.Empty:
                _kill(process)
                what = in_flight or cases[-1]["id"]
                where = "its case" if in_flight else "exiting after its last case"
                # (with the stuck case's thread stacks, dumped by child.py HANG_DUMP seconds before)
                detail = f"no report within {timeout:.0f} s ({where}); log: {_tail(log_path, 6000)}"
                failure = Result(what, "hang", detail, time.monotonic() - case_started)
                break
            if report is None:  # the pipe closed: the child is gone
                status = process.wait()
                if not ready:  # not a case's doing: the suite itself is broken
                    raise RuntimeError(f"a {self.section} child failed to start "
                                       f"({describe(status)}): {_tail(log_path)}")  # fmt: skip
                if (in_flight is not None and not abandoned) or status != 0:
                    what = in_flight or cases[-1]["id"]
                    where = "during its case" if in_flight else "at exit, after its last case"
                    detail = (f"{describe(status)}{_sanitizer_summary(log_path)} {where}; "
                              f"log: {_tail(log_path)}")  # fmt: skip
                    failure = Result(what, "crash", detail, time.monotonic() - case_started)
                break
            if "ready" in report:
                ready = True
                timeout = self.case_timeout
                case_started = time.monotonic()
            elif "done" in report:
                with self._lock:
                    self._peak_rss_kib = max(self._peak_rss_kib, int(report["peak_rss_kib"]))
                timeout = self.exit_timeout
            elif "abandon" in report:  # the child gave up on a stuck thread: a new one goes on
                abandoned = True
                timeout = self.exit_timeout
            else:
                results.append(Result(report["id"], report["outcome"], report.get("detail", ""),
                                      report.get("seconds", 0.0),
                                      report.get("peak_rss_kib", 0)))  # fmt: skip
                case_started = time.monotonic()
                if report["outcome"] == "hang":
                    abandoned = True
        reader.join(5)
        if failure is None and not any(r.outcome in FAILURES for r in results):
            os.unlink(job_path)
            log_path.unlink()
        elif failure is not None:
            failure.detail += f" [job {job_path}]"
        return results, failure


def _read_reports(fd: int, reports: queue.Queue[dict[str, Any] | None]) -> None:
    with os.fdopen(fd, "rb") as pipe:
        for line in pipe:
            try:
                reports.put(json.loads(line))
            except ValueError:
                continue
    reports.put(None)


def _kill(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _sanitizer_summary(path: Path) -> str:
    """The one line that says what a sanitizer stopped a child for (where it ran on a build
    with sanitizers, scripts/sanitizer_reliability.sh): AddressSanitizer's summary, or
    UndefinedBehaviorSanitizer's first "runtime error" (it prints no summary when it stops at
    the first); else ""."""
    summary = error = b""
    try:
        with open(path, "rb") as log:
            for line in log:
                if line.startswith(b"SUMMARY: ") and b"Sanitizer" in line:
                    summary = line
                elif not error and b": runtime error: " in line:
                    error = line
    except OSError:
        return ""
    chosen = summary or error
    return f" ({chosen.decode('utf-8', 'replace').strip()})" if chosen else ""


def _tail(path: Path, size: int = 1500) -> str:
    try:
        data = path.read_bytes()[-size:]
    except OSError:
        return ""
    return data.decode("utf-8", "replace").strip()
