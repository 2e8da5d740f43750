"""What share of the machine's CPUs the worker really gets: the CPUs it may run on, its cgroup's
CPU quota (Kubernetes' CPU limit; cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`), how long its
threads waited for a CPU (the kernel's run delay in /proc/self/task/*/schedstat, plus the time
the quota throttled the cgroup, from its `cpu.stat`), and how long the CPUs it may run on sat
idle (/proc/stat). thread_governor.py decides from these."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def allowed_cpus() -> int:
    """The CPUs this process may run on (its affinity: a cpuset or taskset included)."""
    return len(os.sched_getaffinity(0))


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's cgroup directories that may hold CPU files: v2's, then v1's cpu controller."""
    dirs = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return dirs
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":
            dirs.append(root / relative)
        elif "cpu" in controllers.split(","):
            name = next((d for d in (controllers, "cpu,cpuacct", "cpu") if (root / d).is_dir()), "cpu")
            dirs.append(root / name / relative)
    return dirs


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPUs the cgroup's quota allows (1.5 for `150000 100000`), or None without a quota."""
    for directory in _cgroup_dirs(root, proc_cgroup):
        try:
            if (directory / "cpu.max").is_file():
                quota, period = (directory / "cpu.max").read_text().split()[:2]
                if quota != "max":
                    return int(quota) / int(period)
            elif (directory / "cpu.cfs_quota_us").is_file():
                quota = int((directory / "cpu.cfs_quota_us").read_text())
                period = int((directory / "cpu.cfs_period_us").read_text())
                if quota > 0:
                    return quota / period
        except (OSError, ValueError):
            continue
    return None


def threads_within(cpus: int, limit: float | None) -> int:
    """`cpus` threads, no more than a quota of `limit` CPUs holds whole (None: no quota), at least 1."""
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit + 1e-9)))
    return max(1, cpus)


def default_threads() -> int:
    """Threads for the engine: the CPUs this process may run on, within its cgroup's quota."""
    return threads_within(allowed_cpus(), cgroup_cpu_limit())


class WaitClock:
    """The seconds this process's threads have waited for a CPU so far: run delay summed over
    its threads, plus the cgroup's throttled time when it has a quota. Read it before and
    after a step; the difference is what the step waited.

    Each thread's schedstat stays open between readings and is read again from its start
    (`os.pread`): a reading runs on the engine's thread before a step's reply, and opening
    ~25 files through pathlib each time took ~0.4 ms of it. A thread gone is closed; a thread id
    reused by a new thread reads through the old descriptor no more (the read fails) and is
    opened again at the next reading."""

    def __init__(self, tasks: Path = Path("/proc/self/task"), root: Path = CGROUP_ROOT,
                 proc_cgroup: Path = Path("/proc/self/cgroup")) -> None:
        self._tasks = tasks
        self._throttle_files = [d / "cpu.stat" for d in _cgroup_dirs(root, proc_cgroup) if (d / "cpu.stat").is_file()]
        self._open: dict[str, int] = {}     # thread id -> its schedstat, open

    def available(self) -> bool:
        return any(self._tasks.glob("*/schedstat"))

    def waited_s(self) -> float:
        try:
            threads = os.listdir(self._tasks)
        except OSError:
            threads = []
        for gone in self._open.keys() - set(threads):
            os.close(self._open.pop(gone))
        total_ns = 0
        for thread in threads:
            delay = self._run_delay_ns(thread)
            if delay is not None:
                total_ns += delay
        return total_ns / 1e9 + self._throttled_s()

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()

    def _run_delay_ns(self, thread: str) -> int | None:
        """Its schedstat's second field, None for a thread that ended meanwhile."""
        fd = self._open.get(thread)
        try:
            if fd is None:
                fd = self._open[thread] = os.open(self._tasks / thread / "schedstat", os.O_RDONLY)
            return int(os.pread(fd, 256, 0).split()[1])
        except (OSError, ValueError, IndexError):
            if thread in self._open:
                os.close(self._open.pop(thread))
            return None

    def _throttled_s(self) -> float:
        for path in self._throttle_files:
            try:
                fields = dict(line.split() for line in path.read_text().splitlines() if line.strip())
            except (OSError, ValueError):
                continue
            if "throttled_usec" in fields:          # cgroup v2
                return int(fields["throttled_usec"]) / 1e6
            if "throttled_time" in fields:          # cgroup v1, nanoseconds
                return int(fields["throttled_time"]) / 1e9
        return 0.0


class IdleClock:
    """The seconds the CPUs this process may run on have sat idle so far (idle and iowait in
    /proc/stat, summed over them; a container's /proc/stat is the host's, and its cpuset names
    the CPUs): what one more thread could have used. Read it like WaitClock."""

    def __init__(self, stat: Path = Path("/proc/stat"), cpus: set[int] | None = None) -> None:
        self._stat = stat
        self._cpus = cpus if cpus is not None else os.sched_getaffinity(0)
        self._tick = os.sysconf("SC_CLK_TCK")

    def available(self) -> bool:
        try:
            return self.idle_s() > 0.0
        except OSError:
            return False

    def idle_s(self) -> float:
        ticks = 0
        for line in self._stat.read_text().splitlines():
            name, _, rest = line.partition(" ")
            if name[:3] != "cpu" or not name[3:].isdigit() or int(name[3:]) not in self._cpus:
                continue
            fields = rest.split()
            ticks += int(fields[3]) + int(fields[4])
        return ticks / self._tick
