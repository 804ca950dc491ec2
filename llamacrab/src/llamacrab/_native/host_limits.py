"""How much more memory this process may take: what the machine has available, or less where
a cgroup's limit leaves less; how many more threads it may start where a pids cgroup limits
them; and how many threads to compute on by default.

A container's limits are its cgroups'. Past the memory limit the kernel's OOM killer ends the
process, and past the pids limit GNU OpenMP exits it ("libgomp: Thread creation failed"), with
no error to catch either way. What is left counts what is in use already: a second model or
context that fits the limit alone may not fit beside the first. Linux only; elsewhere (and
where these files cannot be read) there is physical memory (on Windows what may be committed)
and no thread limit, and where even that cannot be read no memory limit.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamacrab._startup_cpus import allowed_cpus

logger = logging.getLogger("llamacrab")

# ggml's per-thread arrays hold GGML_MAX_N_THREADS (ggml.h); past what the system allows, GNU
# OpenMP exits the process when it cannot start a thread (4097 did here, and a projector's 600
# under a 4 GB address space): every thread count llamacrab hands to ggml is 1..this.
GGML_MAX_N_THREADS = 512

# cgroup v1 writes "no limit" as the largest page-aligned 63-bit number; anything this large is
# no limit in practice.
_UNLIMITED = 1 << 62
_warned_lock = threading.Lock()
_warned = False


@dataclass(frozen=True)
class Limit:
    """An amount (bytes, threads) and where it comes from, for a message."""

    amount: int
    source: str


def host_memory_left(
    proc: Path = Path("/proc/self"), meminfo: Path = Path("/proc/meminfo")
) -> Limit:
    """The least of what the machine has available (MemAvailable, plus free swap) and what
    every memory limit of this process's cgroups leaves (their ancestors' too: a parent's
    limit holds for its children): the limit less the memory charged to it that is not file
    cache, which the kernel drops to make room (a mapped model's pages are; what llama.cpp
    allocates is not, and past the limit the OOM killer strikes)."""
    best = _available(meminfo)
    for directory, mount_point, version in _hierarchies(proc, "memory"):
        names = _V2_MEMORY if version == 2 else _V1_MEMORY
        for level in _up_to(directory, mount_point):
            limit = _read_number(level / names[0])
            if limit is None:
                continue
            used = _not_cache(level, names)
            left = max(limit - used, 0)
            if left < best.amount:
                source = f"this process's cgroup ({level / names[0]}: {_size(limit)}"
                best = Limit(left, f"{source}, {_size(used)} in use) leaves")
    return best


# The limit, the usage and its file cache in memory.stat (the hierarchy's, in v1), by version.
_V2_MEMORY = ("memory.max", "memory.current", "file")
_V1_MEMORY = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")


def _available(meminfo: Path) -> Limit:
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines())
        kib = sum(int(fields[key].split()[0]) for key in ("MemAvailable", "SwapFree"))
    except (OSError, ValueError, KeyError, IndexError):
        try:
            physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):  # Windows has no sysconf
            return windows_commit_left() or Limit(
                _UNLIMITED, "no memory size could be read on this machine:"
            )
        return Limit(physical, "this machine has")
    return Limit(kib << 10, "this machine has available (MemAvailable and free swap)")


class _MemoryStatus(ctypes.Structure):
    """Windows' MEMORYSTATUSEX."""

    _fields_ = [("length", ctypes.c_uint32), ("memory_load", ctypes.c_uint32),
                *((name, ctypes.c_uint64) for name in (
                    "total_phys", "avail_phys", "total_page_file", "avail_page_file",
                    "total_virtual", "avail_virtual", "avail_extended_virtual"))]  # fmt: skip


def windows_commit_left(kernel32: Any = None) -> Limit | None:
    """What Windows lets this process commit still (memory and page file: past it, allocations
    fail), from GlobalMemoryStatusEx; None elsewhere or where it fails. Untried on Windows
    itself; ``kernel32`` is for tests."""
    if kernel32 is None:
        windll = getattr(ctypes, "windll", None)  # Windows only
        if windll is None:
            return None
        kernel32 = windll.kernel32
    status = _MemoryStatus(length=ctypes.sizeof(_MemoryStatus))
    if not kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
        return None
    return Limit(status.avail_page_file, "this machine can commit (memory and page file)")


def _not_cache(level: Path, names: tuple[str, str, str]) -> int:
    """What a cgroup level has in use besides file cache (0 where its files cannot be read)."""
    usage = _read_number(level / names[1]) or 0
    try:
        lines = (level / "memory.stat").read_text().splitlines()
    except OSError:
        return usage
    for line in lines:
        key, _, value = line.partition(" ")
        if key == names[2] and value.strip().isdigit():
            return max(usage - int(value), 0)
    return usage


def _size(amount: int) -> str:
    return f"{amount / 2**30:.1f} GiB" if amount >= 2**30 else f"{amount >> 20} MiB"


def thread_room(proc: Path = Path("/proc/self")) -> Limit | None:
    """How many more tasks (threads or processes) this process's pids cgroups let it start,
    the least over their levels; None where none limits it."""
    best: Limit | None = None
    for directory, mount_point, _ in _hierarchies(proc, "pids"):
        for level in _up_to(directory, mount_point):
            most, now = _read_number(level / "pids.max"), _read_number(level / "pids.current")
            if most is None or now is None:
                continue
            room = max(most - now, 0)
            if best is None or room < best.amount:
                best = Limit(room, f"{level / 'pids.max'}: {most}, in use: {now}")
    return best


def threads_within_room(n_threads: int) -> int:
    """``n_threads``, or as many as this process's pids cgroups leave room for: the calling
    thread computes too, so n threads start n - 1 (said once per process)."""
    global _warned
    room = thread_room() if n_threads > 1 else None
    if room is None or n_threads - 1 <= room.amount:
        return n_threads
    with _warned_lock:
        warn, _warned = not _warned, True
    if warn:
        logger.warning(
            "llama.cpp computes on %d threads instead of %d: this process may start %d more "
            "(%s), and GNU OpenMP exits the process when it cannot start one",
            room.amount + 1, n_threads, room.amount, room.source,
        )  # fmt: skip
    return room.amount + 1


def default_threads(
    proc: Path = Path("/proc/self"), cpus: Path = Path("/sys/devices/system/cpu")
) -> Limit:
    """Threads for llama.cpp when none are asked for: one per physical core, as llama.cpp's
    own tools default (a core's hyperthreads share its arithmetic units), among the CPUs this
    process may run on (its affinity: taskset, a cpuset), and no more than its cgroups' CPU
    quota (a container's --cpus) allows. os.cpu_count() counts every CPU of the machine: in
    a container given 2 of 64, 64 threads took turns on 2. On macOS the performance cores (as
    llama.cpp counts them); elsewhere (Windows) every CPU."""
    if sys.platform == "darwin":
        cores = darwin_cores()
        if cores is not None:
            return Limit(cores, "the performance cores of this Mac")
    cpus_allowed = allowed_cpus()
    if cpus_allowed is None:  # no affinity here (macOS, Windows)
        return Limit(os.cpu_count() or 1, "every CPU of this machine")
    allowed = sorted(cpus_allowed)
    cores = _physical_cores(allowed, cpus)
    best = Limit(cores, f"the physical cores of the {len(allowed)} CPUs this process may use")
    quota = cpu_quota(proc)
    if quota is not None and quota.amount < best.amount:
        best = quota
    return best


def darwin_cores(sysctl: Callable[[bytes], int | None] | None = None) -> int | None:
    """macOS's cores for computing: Apple silicon's performance cores (its efficiency cores
    slow a decode down: llama.cpp's tools leave them out too), else the physical cores (an
    Intel Mac); None where neither can be read. Untried on macOS itself."""
    read = sysctl or _sysctl_int
    for name in (b"hw.perflevel0.physicalcpu", b"hw.physicalcpu"):
        value = read(name)
        if value is not None:
            return value
    return None


def _sysctl_int(name: bytes) -> int | None:
    """An integer from sysctlbyname(3) (macOS, the BSDs); None where there is none."""
    try:
        lookup = ctypes.CDLL(None).sysctlbyname
    except (OSError, AttributeError):  # Linux's C library has no sysctlbyname
        return None
    lookup.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                       ctypes.c_void_p, ctypes.c_size_t]  # fmt: skip
    lookup.restype = ctypes.c_int
    value = ctypes.c_int(0)
    size = ctypes.c_size_t(ctypes.sizeof(value))
    if lookup(name, ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
        return None
    return value.value if value.value > 0 else None


def _physical_cores(allowed: list[int], cpus: Path) -> int:
    """How many cores ``allowed`` CPUs make: hyperthreads of one core count once (each CPU's
    thread_siblings_list names its core's CPUs; where unreadable, each CPU is a core)."""
    cores: set[str] = set()
    for cpu in allowed:
        try:
            siblings = (cpus / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
        except OSError:
            siblings = str(cpu)
        cores.add(siblings.strip())
    return max(len(cores), 1)


def cpu_quota(proc: Path = Path("/proc/self")) -> Limit | None:
    """The CPUs' worth of time this process's cgroups allow (quota over period, rounded up),
    the least over their levels; None where none limits it."""
    best: Limit | None = None
    for directory, mount_point, version in _hierarchies(proc, "cpu"):
        for level in _up_to(directory, mount_point):
            quota = _read_quota(level, version)
            if quota is not None and (best is None or quota.amount < best.amount):
                best = quota
    return best


def _read_quota(level: Path, version: int) -> Limit | None:
    if version == 2:
        try:
            quota, period = (level / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            return None
        source = level / "cpu.max"
    else:
        try:
            quota = (level / "cpu.cfs_quota_us").read_text().strip()
            period = (level / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
        source = level / "cpu.cfs_quota_us"
    if not quota.isdigit() or not period.isdigit() or int(period) == 0:  # "max", -1: no quota
        return None
    cpus = max(math.ceil(int(quota) / int(period)), 1)
    return Limit(cpus, f"this process's CPU quota ({source}: {quota} per {period})")


def _hierarchies(proc: Path, controller: str) -> list[tuple[Path, Path, int]]:
    """The process's cgroup directory, its hierarchy's mount point and the cgroup version, for
    the v2 hierarchy and the v1 hierarchy of ``controller``, as far as they are mounted."""
    try:
        memberships = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    paths: dict[int, str] = {}
    for line in memberships:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            paths[2] = path
        elif controller in controllers.split(","):
            paths[1] = path
    found = []
    for line in mounts:
        fields = line.split()
        if "-" not in fields:
            continue
        tail = fields[fields.index("-") + 1 :]
        root, mount_point = fields[3], Path(fields[4])
        if tail[0] == "cgroup2" and 2 in paths:
            found.append((_inside(mount_point, root, paths[2]), mount_point, 2))
        elif tail[0] == "cgroup" and controller in tail[-1].split(",") and 1 in paths:
            found.append((_inside(mount_point, root, paths[1]), mount_point, 1))
    return found


def _inside(mount_point: Path, root: str, path: str) -> Path:
    """Where cgroup ``path`` lies under a mount of the hierarchy's ``root`` (a container
    mounts its own cgroup as the root: then the mount point itself)."""
    if path == root or not path.startswith(root.rstrip("/") + "/"):
        return mount_point
    return mount_point / path[len(root.rstrip("/")) :].lstrip("/")


def _up_to(directory: Path, mount_point: Path) -> list[Path]:
    levels = [directory]
    while directory != mount_point and mount_point in directory.parents:
        directory = directory.parent
        levels.append(directory)
    return levels


def _read_number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max", or nothing readable
        return None
    value = int(text)
    return value if value < _UNLIMITED else None
