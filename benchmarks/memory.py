"""Resident memory of processes, for the benchmarks' reports.

    resident_mb()                        # this process (an in-process engine)
    service_resident_mb({"gateway": pid, "worker-0": pid, ...})   # a running stack
    service_peak_resident_mb({...})      # each one's high-water mark since it started (VmHWM)

A service counts its whole process tree (a worker's compiler or helper children
included). Figures are VmRSS from /proc (Linux), else psutil's rss: the pages a
process holds in memory, file-backed ones (mapped weights, libraries) included.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import psutil

from benchmarks.process_tree import tree_pids

MB = 1 << 20


def _status_bytes(pid: int, field: str = "VmRSS:") -> int | None:
    """A field of /proc/<pid>/status given in kB, as bytes; None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def tree_peak_resident_mb(pid: int) -> float | None:
    """The high-water mark of a process's resident memory since it started (VmHWM: its start-up
    included, which no sampling misses), summed over its tree's living processes (an upper bound
    on the tree's own peak); None where /proc has no VmHWM."""
    peaks = [_status_bytes(member, "VmHWM:") for member in tree_pids(pid)]
    if not peaks or any(peak is None for peak in peaks):
        return None
    return sum(peaks) / MB


def service_peak_resident_mb(pids: Mapping[str, int]) -> dict[str, float]:
    """Each named service's `tree_peak_resident_mb`, leaving out those /proc does not give."""
    found = {name: tree_peak_resident_mb(pid) for name, pid in pids.items()}
    return {name: value for name, value in found.items() if value is not None}


def resident_bytes(pid: int | None = None) -> int:
    """One process's resident bytes (this one by default); 0 once it has gone."""
    pid = psutil.Process(pid).pid if pid is None else pid
    found = _status_bytes(pid)
    if found is not None:
        return found
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.NoSuchProcess:
        return 0


def resident_mb(pid: int | None = None) -> float:
    return resident_bytes(pid) / MB


def tree_resident_bytes(pid: int) -> int:
    """A process and all its descendants, summed; 0 when it has gone."""
    return sum(resident_bytes(member) for member in tree_pids(pid))


def service_resident_mb(pids: Mapping[str, int]) -> dict[str, float]:
    """Each named service's resident MB (its process tree), in the order given."""
    return {name: tree_resident_bytes(pid) / MB for name, pid in pids.items()}


def render_memory(resident: Mapping[str, float]) -> str:
    """A markdown table of resident MB per service."""
    lines = ["| service | resident MB |", "|---|---:|"]
    lines += [f"| {name} | {value:,.0f} |" for name, value in resident.items()]
    return "\n".join(lines)
