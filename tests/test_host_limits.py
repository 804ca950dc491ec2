"""What a process may still take: the machine's available memory or what a cgroup's limit leaves
where that is less, the threads a pids cgroup leaves room for, and the threads it computes on by
default."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from llamacrab._native.host_limits import (
    _sysctl_int,
    cpu_quota,
    darwin_cores,
    default_threads,
    host_memory_left,
    thread_room,
    windows_commit_left,
)

from support import load_repo_module

PHYSICAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
GIB = 1 << 30


def _fake_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(textwrap.dedent(cgroup).lstrip())
    (proc / "mountinfo").write_text(textwrap.dedent(mountinfo).lstrip().format(root=tmp_path))
    return proc


def _meminfo(tmp_path: Path, available: int, swap_free: int = 0) -> Path:
    """A /proc/meminfo whose MemAvailable and SwapFree are these (bytes)."""
    path = tmp_path / "meminfo"
    path.write_text(
        f"MemTotal: {2 * available >> 10} kB\nMemAvailable: {available >> 10} kB\n"
        f"SwapTotal: {swap_free >> 10} kB\nSwapFree: {swap_free >> 10} kB\n"
    )
    return path


def _left(proc: Path, tmp_path: Path) -> int:
    """What is left with the machine's 64 GiB available: the cgroups decide."""
    return host_memory_left(proc, _meminfo(tmp_path, 64 * GIB)).amount


def _limit(directory: Path, name: str, value: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(value + "\n")


def test_a_v2_parent_limit_holds_for_its_children(tmp_path: Path) -> None:
    proc = _fake_proc(
        tmp_path,
        "0::/user.slice/app.scope\n",
        "41 31 0:38 / {root}/unified rw,relatime - cgroup2 cgroup2 rw\n",
    )
    _limit(tmp_path / "unified/user.slice", "memory.max", str(GIB))
    _limit(tmp_path / "unified/user.slice/app.scope", "memory.max", "max")
    left = host_memory_left(proc, _meminfo(tmp_path, 64 * GIB))
    assert left.amount == GIB
    assert "unified/user.slice/memory.max: 1.0 GiB, 0 MiB in use) leaves" in left.source


def test_a_container_sees_its_own_cgroup_as_the_mount_root(tmp_path: Path) -> None:
    # In a cgroup namespace the process's path and the mount's root are both "/".
    proc = _fake_proc(
        tmp_path,
        "0::/\n",
        "30 20 0:26 / {root}/cg ro,nosuid - cgroup2 cgroup2 rw\n",
    )
    _limit(tmp_path / "cg", "memory.max", str(512 << 20))
    assert _left(proc, tmp_path) == 512 << 20


def test_v1_reads_the_memory_controller_below_the_mount_root(tmp_path: Path) -> None:
    proc = _fake_proc(
        tmp_path,
        """
        5:cpu,cpuacct:/docker/abc
        4:memory:/docker/abc
        0::/
        """,
        """
        32 31 0:29 /docker /{root}/cpu rw - cgroup cgroup rw,cpu,cpuacct
        35 31 0:32 /docker {root}/memory rw,relatime - cgroup cgroup rw,memory
        """,
    )
    # The mount's root is /docker: the process's cgroup is memory/abc; "no limit" is 2^63-4096.
    _limit(tmp_path / "memory", "memory.limit_in_bytes", str(2 * GIB))
    _limit(tmp_path / "memory/abc", "memory.limit_in_bytes", "9223372036854771712")
    left = host_memory_left(proc, _meminfo(tmp_path, 64 * GIB))
    assert left.amount == 2 * GIB
    assert f"({tmp_path}/memory/memory.limit_in_bytes: 2.0 GiB" in left.source


@pytest.mark.parametrize("value", ["max", "9223372036854771712", "", "garbage"])
def test_no_limit_or_an_unreadable_one_leaves_the_machine_s_memory(
    tmp_path: Path, value: str
) -> None:
    proc = _fake_proc(tmp_path, "0::/a\n", "41 31 0:38 / {root}/u rw - cgroup2 cgroup2 rw\n")
    _limit(tmp_path / "u/a", "memory.max", value)
    assert _left(proc, tmp_path) == 64 * GIB
    missing = tmp_path / "missing"
    assert host_memory_left(missing, missing).amount == PHYSICAL
    assert host_memory_left(missing, missing).source == "this machine has"


def test_what_is_in_use_counts_but_file_cache_does_not(tmp_path: Path) -> None:
    # v2: 600 MiB charged, 200 MiB of it file cache (a mapped model's pages): 400 MiB in use.
    proc = _fake_proc(tmp_path, "0::/a\n", "41 31 0:38 / {root}/u rw - cgroup2 cgroup2 rw\n")
    _limit(tmp_path / "u/a", "memory.max", str(GIB))
    _limit(tmp_path / "u/a", "memory.current", str(600 << 20))
    _limit(tmp_path / "u/a", "memory.stat", f"anon {400 << 20}\nfile {200 << 20}")
    assert _left(proc, tmp_path) == GIB - (400 << 20)


def test_v1_counts_the_hierarchy_s_cache(tmp_path: Path) -> None:
    proc = _fake_proc(
        tmp_path, "4:memory:/b\n", "35 31 0:32 / {root}/m rw - cgroup cgroup rw,memory\n"
    )
    _limit(tmp_path / "m/b", "memory.limit_in_bytes", str(GIB))
    _limit(tmp_path / "m/b", "memory.usage_in_bytes", str(900 << 20))
    _limit(tmp_path / "m/b", "memory.stat", f"cache 1\ntotal_cache {100 << 20}")
    assert _left(proc, tmp_path) == GIB - (800 << 20)
    # Usage past the limit (reclaim lags) leaves nothing, not a negative amount.
    _limit(tmp_path / "m/b", "memory.usage_in_bytes", str(2 * GIB))
    assert _left(proc, tmp_path) == 0


def test_the_machine_s_share_is_what_it_has_available_and_free_swap(tmp_path: Path) -> None:
    missing = tmp_path / "no-proc"
    left = host_memory_left(missing, _meminfo(tmp_path, 3 * GIB, swap_free=GIB))
    assert left.amount == 4 * GIB
    assert left.source == "this machine has available (MemAvailable and free swap)"


def test_windows_share_is_what_it_may_commit() -> None:
    class Kernel32:  # GlobalMemoryStatusEx fills the structure it is handed and answers nonzero
        def __init__(self, answer: int) -> None:
            self.answer = answer

        def GlobalMemoryStatusEx(self, ref: Any) -> int:
            status = ref._obj
            assert status.length == ctypes.sizeof(status) == 64  # MEMORYSTATUSEX's size
            status.avail_phys, status.avail_page_file = GIB, 5 * GIB
            return self.answer

    left = windows_commit_left(Kernel32(1))
    assert left is not None and left.amount == 5 * GIB
    assert "commit" in left.source
    assert windows_commit_left(Kernel32(0)) is None  # the call failed
    if sys.platform != "win32":
        assert windows_commit_left() is None


@pytest.fixture
def cgroup() -> Iterator[Callable[[str, str, int], Path]]:
    """Makes v1 cgroups of a controller ("memory", "pids") below this process's own, with one
    limit file set (root and a writable hierarchy needed: CI's machine has both)."""
    made: list[Path] = []

    def make(controller: str, limit_file: str, limit: int) -> Path:
        here = _own_v1_cgroup(controller)
        if here is None:
            pytest.skip(f"no cgroup v1 {controller} controller to make a limited cgroup in")
        group = here / f"llamacrab-test-{os.getpid()}-{len(made)}"
        try:
            group.mkdir()
            made.append(group)
            (group / limit_file).write_text(str(limit))
        except OSError as error:
            pytest.skip(f"cannot make a {controller} cgroup here: {error}")
        return group

    yield make
    for group in made:
        group.rmdir()


def _own_v1_cgroup(controller: str) -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            directory = Path("/sys/fs/cgroup") / controller / path.lstrip("/")
            return directory if directory.is_dir() else None
    return None


def _run_in(
    group: Path, program: str, environment: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``program`` in a child interpreter inside cgroup ``group``, its log messages on
    stderr: the shell joins the cgroup, then becomes the interpreter."""
    join = f'echo $$ > "{group}/cgroup.procs" && exec "$0" -c "$1"'
    logged = 'import logging\nlogging.basicConfig(format="%(message)s")\n'
    child = subprocess.run(
        ["sh", "-c", join, sys.executable, logged + textwrap.dedent(program)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(environment or {})},
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    return child


@pytest.mark.parametrize(
    ("kept_cells", "refused_cells", "needs", "leaves"),
    [
        # 2^23 cells of the tiny model take 2.4 GiB (cells, keys and values): far below this
        # machine's memory, past the cgroup's. Before, llama.cpp zero-filled them and the OOM
        # killer ended the process.
        (256, 2**23, "2.4", r"(0\.9|1\.0)"),
        # 2^21 cells take 0.6 GiB: one fits the 1 GiB cgroup, two do not. Before, each was
        # compared with the whole limit: the second passed, and the OOM killer ended the
        # process with the first.
        (2**21, 2**21, "0.6", r"0\.[34]"),
    ],
    ids=["past the limit", "past what the first context leaves"],
)
def test_a_context_past_what_the_cgroup_leaves_is_refused_not_killed(
    cgroup: Callable[[str, str, int], Path],
    tiny_model_path: Path,
    kept_cells: int,
    refused_cells: int,
    needs: str,
    leaves: str,
) -> None:
    group = cgroup("memory", "memory.limit_in_bytes", GIB)
    child = _run_in(
        group,
        f"""
        from llamacrab import ContextError, Llama
        kept = Llama({str(tiny_model_path)!r}, n_ctx={kept_cells}, n_ubatch=1, n_threads=1)
        try:
            Llama({str(tiny_model_path)!r}, n_ctx={refused_cells}, n_ubatch=1, n_threads=1)
        except ContextError as error:
            print(error)
        answer = kept.create_completion("the cat", max_tokens=2, temperature=0)
        print(answer.usage.completion_tokens)
        """,
    )
    refusal, tokens = child.stdout.strip().splitlines()
    assert f"n_ctx {refused_cells} needs {needs} GiB of host memory" in refusal
    assert f"this process's cgroup ({group}/memory.limit_in_bytes: 1.0 GiB, " in refusal
    assert re.search(rf"\d+ MiB in use\) leaves {leaves} GiB$", refusal), refusal
    assert tokens == "2"


def test_weights_past_the_cgroup_limit_without_mmap_are_refused_not_killed(
    cgroup: Callable[[str, str, int], Path], gemma_path: Path, tiny_model_path: Path
) -> None:
    # Gemma 3 270M's 241 MiB of weights read into a 160 MiB cgroup: the OOM killer before.
    group = cgroup("memory", "memory.limit_in_bytes", 160 << 20)
    child = _run_in(
        group,
        f"""
        from llamacrab import Llama, ModelLoadError
        try:
            Llama({str(gemma_path)!r}, use_mmap=False, n_ctx=256, n_threads=1)
        except ModelLoadError as error:
            print(error)
        mapped = Llama({str(tiny_model_path)!r}, use_mmap=False, n_ctx=256, n_threads=1)
        answer = mapped.create_completion("the cat", max_tokens=2, temperature=0)
        print(answer.usage.completion_tokens)
        """,
    )
    refusal, tokens = child.stdout.strip().splitlines()
    assert "GiB of weights do not fit in memory without mmap" in refusal
    assert re.search(
        r": 160 MiB, \d+ MiB in use\) leaves 0\.1 GiB\): load it with use_mmap", refusal
    )
    assert tokens == "2"


def test_thread_room_is_the_least_over_the_pids_hierarchy(tmp_path: Path) -> None:
    proc = _fake_proc(
        tmp_path,
        """
        8:pids:/jobs/one
        0::/
        """,
        "39 31 0:36 / {root}/pids rw,relatime - cgroup cgroup rw,pids\n",
    )
    _limit(tmp_path / "pids/jobs", "pids.max", "10")
    _limit(tmp_path / "pids/jobs", "pids.current", "7")
    _limit(tmp_path / "pids/jobs/one", "pids.max", "max")
    _limit(tmp_path / "pids/jobs/one", "pids.current", "5")
    room = thread_room(proc)
    assert room is not None and room.amount == 3
    assert room.source == f"{tmp_path}/pids/jobs/pids.max: 10, in use: 7"
    _limit(tmp_path / "pids/jobs", "pids.max", "max")
    assert thread_room(proc) is None
    assert thread_room(tmp_path / "missing") is None


def test_the_cpu_quota_is_the_least_over_both_hierarchies_rounded_up(tmp_path: Path) -> None:
    proc = _fake_proc(
        tmp_path,
        """
        4:cpu,cpuacct:/docker/box
        0::/job
        """,
        """
        41 31 0:38 / {root}/unified rw,relatime - cgroup2 cgroup2 rw
        39 31 0:36 / {root}/cpu rw,relatime - cgroup cgroup rw,cpu,cpuacct
        """,
    )
    _limit(tmp_path / "unified/job", "cpu.max", "max 100000")  # no quota
    assert cpu_quota(proc) is None
    _limit(tmp_path / "cpu/docker/box", "cpu.cfs_quota_us", "-1")
    _limit(tmp_path / "cpu/docker/box", "cpu.cfs_period_us", "100000")
    assert cpu_quota(proc) is None
    _limit(tmp_path / "cpu/docker", "cpu.cfs_quota_us", "250000")  # --cpus=2.5, a level up
    _limit(tmp_path / "cpu/docker", "cpu.cfs_period_us", "100000")
    quota = cpu_quota(proc)
    assert quota is not None and quota.amount == 3
    assert f"{tmp_path}/cpu/docker/cpu.cfs_quota_us: 250000 per 100000" in quota.source
    _limit(tmp_path / "unified/job", "cpu.max", "50000 100000")  # half a CPU: still one thread
    quota = cpu_quota(proc)
    assert quota is not None and quota.amount == 1 and "unified/job/cpu.max" in quota.source
    assert cpu_quota(tmp_path / "missing") is None


def test_default_threads_are_physical_cores_of_the_cpus_a_process_may_use(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    cpus = tmp_path / "cpu"
    for cpu in allowed:  # pairs of hyperthreads: (0, 1), (2, 3), ...
        first = cpu - cpu % 2
        _limit(cpus / f"cpu{cpu}/topology", "thread_siblings_list", f"{first}-{first + 1}")
    no_quota = _fake_proc(tmp_path, "0::/\n", "")
    expected = len({cpu - cpu % 2 for cpu in allowed})
    assert default_threads(no_quota, cpus).amount == expected
    assert default_threads(no_quota, tmp_path / "no-topology").amount == len(allowed)
    # In a child bound to one CPU, a context computes on one thread unless told otherwise.
    code = (
        "import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from llamacrab import Llama; "
        "llm = Llama(sys.argv[1], n_ctx=64); print(llm.context.n_threads); llm.close(); "
        "llm = Llama(sys.argv[1], n_ctx=64, n_threads=3); print(llm.context.n_threads)"
    )
    model = load_repo_module("scripts/make_tiny_gguf.py").write_tiny_llama(tmp_path / "m.gguf")
    child = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert child.stdout.split() == ["1", "3"], child.stderr[-2000:]
    # OpenMP told to bind its threads pins the thread that loads it: counted before that.
    code = (
        "import sys; from llamacrab import Llama; "
        "print(Llama(sys.argv[1], n_ctx=64).context.n_threads)"
    )
    bound_env = {**os.environ, "OMP_PROC_BIND": "true"}
    bound = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True,
                           text=True, timeout=120, env=bound_env)  # fmt: skip
    assert bound.stdout.split() == [str(default_threads().amount)], bound.stderr[-2000:]


def test_a_mac_computes_on_its_performance_cores() -> None:
    # Apple silicon: performance cores only, as llama.cpp counts them; an Intel Mac: physical.
    apple = {b"hw.perflevel0.physicalcpu": 8, b"hw.physicalcpu": 12}
    assert darwin_cores(apple.get) == 8
    assert darwin_cores({b"hw.physicalcpu": 6}.get) == 6
    assert darwin_cores({}.get) is None
    if sys.platform.startswith("linux"):
        assert _sysctl_int(b"hw.physicalcpu") is None  # glibc has no sysctlbyname: no error


def test_threads_past_the_pids_limit_are_capped_not_killed(
    cgroup: Callable[[str, str, int], Path], tiny_model_path: Path
) -> None:
    # A pids limit of 3 leaves the interpreter (and any thread of its own) room for one or two
    # more: llama.cpp computes on that many plus the caller. Before, GNU OpenMP could not start
    # its threads and exited the process (status 1).
    group = cgroup("pids", "pids.max", 3)
    child = _run_in(
        group,
        f"""
        from llamacrab import Llama
        llm = Llama({str(tiny_model_path)!r}, n_ctx=64, n_threads=4, n_threads_batch=4)
        answer = llm.create_completion("the cat", max_tokens=2, temperature=0)
        print(answer.usage.completion_tokens)
        """,
    )
    assert child.stdout.strip() == "2"
    warnings = [line for line in child.stderr.splitlines() if "computes on" in line]
    assert len(warnings) == 1, child.stderr
    pattern = (
        r"llama.cpp computes on (\d) threads instead of 4: this process may start (\d) more "
        rf"\({re.escape(str(group))}/pids.max: 3, in use: (\d)\), and GNU OpenMP exits"
    )
    found = re.match(pattern, warnings[0])
    assert found is not None, warnings[0]
    threads, room, in_use = map(int, found.groups())
    assert threads == room + 1 == 3 - in_use + 1 and threads < 4


def test_no_thread_to_be_had_is_a_clean_refusal_or_done_in_place(
    cgroup: Callable[[str, str, int], Path], tiny_model_path: Path, tmp_path: Path
) -> None:
    # A pids limit already reached: parallel slots raised RuntimeError ("can't start new
    # thread") from deep inside, with the model left open; a DiskCache kept its states pending
    # for ever; a registry's keep-alive never ran again.
    group = cgroup("pids", "pids.max", 1)
    child = _run_in(
        group,
        f"""
        from llamacrab import ContextError, DiskCache, Llama, ModelRegistry
        model = {str(tiny_model_path)!r}
        try:
            Llama(model, n_ctx=128, n_threads=1, parallel=2)
        except ContextError as error:
            print(error)
        cache = DiskCache({str(tmp_path / "cache")!r})
        with Llama(model, n_ctx=128, n_threads=1, cache=cache) as llm:
            answer = llm.create_completion("the cat", max_tokens=2, temperature=0)
            print(answer.usage.completion_tokens)
        print(len(cache), len(cache._pending))
        with ModelRegistry(keep_alive=60) as registry:
            registry.add("tiny", model, n_ctx=128, n_threads=1)
            print(registry.get("tiny").create_completion("a", max_tokens=1).usage.total_tokens)
        """,
        environment={"OPENBLAS_NUM_THREADS": "1"},  # numpy's OpenBLAS wants threads too
    )
    refusal, tokens, cached, served = child.stdout.strip().splitlines()
    assert refusal.startswith("cannot start the engine thread of 2 parallel slots: ")
    assert (tokens, cached, served) == ("2", "1 0", "3")
    assert "keep_alive cannot unload idle models for now" in child.stderr
