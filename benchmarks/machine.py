"""What a benchmark ran on, for the header of its table."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (e.g. "AMD EPYC", "Intel(R) Xeon(R) Platinum 8488C"), or the
    architecture where the system does not say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
