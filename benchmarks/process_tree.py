"""The processes of a running service: its root and every descendant."""

from __future__ import annotations

import psutil


def tree_pids(pid: int) -> list[int]:
    """The pid and its living descendants' pids; empty once the root has gone."""
    try:
        process = psutil.Process(pid)
        return [process.pid, *(child.pid for child in process.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []
