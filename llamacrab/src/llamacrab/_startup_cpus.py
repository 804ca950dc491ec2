"""The CPUs this process may run on, read when llamacrab is first imported: before llama.cpp's
OpenMP loads, which with ``OMP_PROC_BIND`` or ``OMP_PLACES`` set pins the loading thread to one
CPU (its first place). Read later, that thread's affinity made the default thread count 1."""

from __future__ import annotations

import os


def _affinity() -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity here (macOS, Windows)
        return None


AT_IMPORT = _affinity()


def allowed_cpus() -> frozenset[int] | None:
    """The CPUs this process may use: as at import where OpenMP binds its threads (it pinned
    the importing thread since), else as now (a later ``os.sched_setaffinity`` counts)."""
    binds = os.environ.get("OMP_PROC_BIND", "false").strip().lower() not in ("false", "")
    if (binds or os.environ.get("OMP_PLACES")) and AT_IMPORT is not None:
        return AT_IMPORT
    return _affinity()
