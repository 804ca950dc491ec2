"""One line describing this machine, for the benchmark and reliability reports."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def describe() -> str:
    """CPU model, logical CPUs, memory, OS and Python: what a reader needs to compare runs."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
               platform.processor())  # fmt: skip
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, {memory:.0f} GiB memory, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}"
    )
