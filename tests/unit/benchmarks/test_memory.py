"""Resident memory per process and per process tree (benchmarks/memory.py), now and at its
high-water mark since the process started."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from benchmarks.memory import (render_memory, resident_bytes, resident_mb, service_peak_resident_mb,
                               service_resident_mb, tree_peak_resident_mb, tree_resident_bytes)

HOLD_64_MB = "import sys, time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); " \
             "print('ready', flush=True); time.sleep(60)"


def _spawn(code: str) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


def test_this_process_agrees_with_psutil() -> None:
    ours, theirs = resident_bytes(), psutil.Process(os.getpid()).memory_info().rss
    assert abs(ours - theirs) < 16 << 20
    assert resident_mb() > 1


def test_a_process_tree_counts_its_children() -> None:
    parent = _spawn("import subprocess, sys, time; "
                    f"c = subprocess.Popen([sys.executable, '-c', {HOLD_64_MB!r}], stdout=subprocess.PIPE, text=True); "
                    "assert c.stdout.readline().strip() == 'ready'; print('ready', flush=True); time.sleep(60)")
    try:
        own = resident_bytes(parent.pid)
        tree = tree_resident_bytes(parent.pid)
        assert tree - own >= 64 << 20                      # the child's touched 64 MB
        resident = service_resident_mb({"stack": parent.pid})
        assert list(resident) == ["stack"] and resident["stack"] >= 64
        assert "| stack |" in render_memory(resident)
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()


def test_a_process_that_has_gone_counts_nothing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    time.sleep(0.1)
    assert tree_resident_bytes(child.pid) == 0
    assert service_peak_resident_mb({"gone": child.pid}) == {}        # nor a high-water mark


PEAK_THEN_LET_GO = "import mmap, time; m = mmap.mmap(-1, 96 << 20); m[::4096] = b'x' * len(m[::4096]); " \
                   "m.close(); print('ready', flush=True); time.sleep(60)"


def test_the_high_water_mark_keeps_a_peak_that_has_gone() -> None:
    """96 MB touched and unmapped before the reading: resident now is far below it, the
    high-water mark (VmHWM) still holds it, as a service's start-up peak is kept."""
    child = _spawn(PEAK_THEN_LET_GO)
    try:
        now = tree_resident_bytes(child.pid) / (1 << 20)
        peak = tree_peak_resident_mb(child.pid)
        if peak is None:
            pytest.skip("no VmHWM in /proc here")
        assert peak >= now + 90
        assert service_peak_resident_mb({"svc": child.pid}) == {"svc": peak}
    finally:
        child.kill()
        child.wait()
