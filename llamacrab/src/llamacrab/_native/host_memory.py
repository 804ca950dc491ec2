"""How much memory this process may use: the machine's, or less where a cgroup limits it.

A container's memory limit is a cgroup's: past it the kernel's OOM killer ends the process,
with no error to catch, long before the machine runs out. Linux only; elsewhere (and where the
cgroup files cannot be read) the machine's physical memory is the answer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes "no limit" as the largest page-aligned 63-bit number; anything this large is
# no limit in practice.
_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    """``bytes`` of memory, and where the limit comes from, for an error message."""

    bytes: int
    source: str


def host_memory_limit(proc: Path = Path("/proc/self")) -> MemoryLimit:
    """The least of physical memory and every memory limit of this process's cgroups (their
    ancestors' too: a parent's limit holds for its children)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    best = MemoryLimit(physical, "this machine has")
    for directory, mount_point, limit_file in _cgroup_directories(proc):
        for level in _up_to(directory, mount_point):
            value = _read_limit(level / limit_file)
            if value is not None and value < best.bytes:
                best = MemoryLimit(value, f"this process's cgroup ({level / limit_file}) allows")
    return best


def _cgroup_directories(proc: Path) -> list[tuple[Path, Path, str]]:
    """The process's cgroup directory, its hierarchy's mount point and the limit file's name,
    for the cgroup v2 hierarchy and the v1 memory controller, as far as they are mounted."""
    try:
        memberships = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    paths: dict[str, str] = {}  # "" for v2, "memory" for the v1 controller
    for line in memberships:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            paths[""] = path
        elif "memory" in controllers.split(","):
            paths["memory"] = path
    found = []
    for line in mounts:
        fields = line.split()
        if "-" not in fields:
            continue
        tail = fields[fields.index("-") + 1 :]
        root, mount_point = fields[3], Path(fields[4])
        if tail[0] == "cgroup2" and "" in paths:
            directory = _inside(mount_point, root, paths[""])
            found.append((directory, mount_point, "memory.max"))
        elif tail[0] == "cgroup" and "memory" in tail[-1].split(",") and "memory" in paths:
            directory = _inside(mount_point, root, paths["memory"])
            found.append((directory, mount_point, "memory.limit_in_bytes"))
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


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max" (v2), or nothing readable
        return None
    value = int(text)
    return value if value < _UNLIMITED else None
