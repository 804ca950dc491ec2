"""What this process may use: the machine's memory, or less where a cgroup limits it, and how
many more threads it may start where a pids cgroup limits them.

A container's limits are its cgroups'. Past the memory limit the kernel's OOM killer ends the
process, and past the pids limit GNU OpenMP exits it ("libgomp: Thread creation failed"), with
no error to catch either way. Linux only; elsewhere (and where the cgroup files cannot be read)
there is physical memory and no thread limit.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("llamacrab")

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


def host_memory_limit(proc: Path = Path("/proc/self")) -> Limit:
    """The least of physical memory and every memory limit of this process's cgroups (their
    ancestors' too: a parent's limit holds for its children)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    best = Limit(physical, "this machine has")
    for directory, mount_point, version in _hierarchies(proc, "memory"):
        name = "memory.max" if version == 2 else "memory.limit_in_bytes"
        for level in _up_to(directory, mount_point):
            value = _read_number(level / name)
            if value is not None and value < best.amount:
                best = Limit(value, f"this process's cgroup ({level / name}) allows")
    return best


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
