"""benchmarks/cpu_time.py: per-service CPU seconds between start and finish."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.cpu_time import CpuMeter, client_meter, process_cpu_seconds, tree_cpu_seconds


def test_the_meter_reports_each_service_s_seconds_since_start() -> None:
    readings = {1: iter([2.0, 5.5]), 2: iter([1.0, 1.0])}
    meter = CpuMeter({"worker": 1, "gateway": 2}, read=lambda pid: next(readings[pid])).start()
    assert meter.finish() == {"worker": 3.5, "gateway": 0.0}


def test_a_process_tree_s_children_count_and_a_gone_process_reads_zero() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while tree_cpu_seconds(child.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_cpu_seconds(child.pid) >= 0.3
        assert tree_cpu_seconds(os.getpid()) >= tree_cpu_seconds(child.pid)     # the child is in our tree
        # the tree less this process alone is the child (read a moment apart: 10 ms ticks)
        assert tree_cpu_seconds(os.getpid()) - process_cpu_seconds(os.getpid()) >= 0.28
    finally:
        child.kill()
        child.wait()
    assert tree_cpu_seconds(child.pid) == process_cpu_seconds(child.pid) == 0.0


def test_the_client_meter_reads_this_process_alone() -> None:
    meter = client_meter().start()
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert list(meter.finish()) == ["client"]
