"""CPU seconds each service of a running system spends over a stretch of time:
the user and system time of its whole process tree (children that exit before
the end are not counted), read at the start and at the end.

    meter = CpuMeter({"gateway": pid, "worker-0": pid, ...}).start()
    ...                                   # the run
    seconds = meter.finish()              # {"gateway": 1.9, "worker-0": 41.0, ...}

A benchmark that started the system holds its services as children, so its own
time is read apart from its tree (`client_meter`).

On a machine with as many cores as the worker has threads, every CPU second
another service spends is taken from the worker's steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import psutil

from benchmarks.process_tree import tree_pids

ReadSeconds = Callable[[int], float]     # pid -> CPU seconds of its process tree so far


def process_cpu_seconds(pid: int) -> float:
    """User and system seconds of one process (its own threads, no children); 0 once gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def tree_cpu_seconds(pid: int) -> float:
    """User and system seconds of a process and its living descendants; 0 once gone."""
    return sum((process_cpu_seconds(member) for member in tree_pids(pid)), 0.0)


class CpuMeter:
    def __init__(self, services: Mapping[str, int], read: ReadSeconds = tree_cpu_seconds) -> None:
        self._services = dict(services)
        self._read = read
        self._start: dict[str, float] = {}

    def start(self) -> CpuMeter:
        self._start = {name: self._read(pid) for name, pid in self._services.items()}
        return self

    def finish(self) -> dict[str, float]:
        """Each service's CPU seconds since start, in the order given."""
        return {name: max(self._read(pid) - self._start[name], 0.0) for name, pid in self._services.items()}


def client_meter() -> CpuMeter:
    """This process alone (the benchmark's client), under the name `client`."""
    return CpuMeter({"client": os.getpid()}, read=process_cpu_seconds)
