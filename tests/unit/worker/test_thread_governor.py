"""The engine's thread count on shared cores (engine/cpu/thread_governor.py, cpu_share.py,
thread_pacer.py): one thread fewer when the threads wait for a CPU, probes back up with
backoff, the cgroup quota read as Kubernetes sets it (v1 and v2), the waiting read from the
kernel's per-thread statistics, and the pacer setting the count on the engine's thread."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.engine.cpu.cpu_share import WaitClock, cgroup_cpu_limit, default_threads
from services.worker.engine.cpu.thread_governor import GovernorConfig, ThreadGovernor
from services.worker.engine.cpu.thread_pacer import ThreadPacer

STEP_S = 0.1


def run(governor: ThreadGovernor, seconds: float, share: float, start_s: float) -> float:
    """Steps of STEP_S for `seconds`, each with threads x `share` of its time waited; returns the clock."""
    now = start_s
    while now < start_s + seconds - 1e-9:
        now += STEP_S
        governor.observe(STEP_S, STEP_S * governor.threads * share, now)
    return now


def test_idle_cores_keep_every_thread() -> None:
    governor = ThreadGovernor(GovernorConfig(max_threads=2), 0.0)
    run(governor, 30.0, 0.01, 0.0)
    assert governor.threads == 2 and not governor.probing


def test_waiting_for_a_cpu_drops_a_thread_within_a_window() -> None:
    governor = ThreadGovernor(GovernorConfig(max_threads=4), 0.0)
    run(governor, 0.5, 0.4, 0.0)
    assert governor.threads == 3
    run(governor, 1.0, 0.4, 0.5)
    assert governor.threads == 1                     # and on to the floor
    run(governor, 1.0, 0.9, 1.5)
    assert governor.threads == 1                     # never below min_threads


def test_slow_steps_are_judged_by_time_not_count() -> None:
    governor = ThreadGovernor(GovernorConfig(max_threads=2), 0.0)
    governor.observe(0.4, 0.4 * 2 * 0.5, 0.4)        # a collapsed step: not half a second yet
    assert governor.threads == 2
    governor.observe(0.4, 0.4 * 2 * 0.5, 0.8)
    assert governor.threads == 1


def test_a_probe_that_still_waits_goes_back_and_backs_off() -> None:
    governor = ThreadGovernor(GovernorConfig(max_threads=2, probe_after_s=5.0, probe_max_s=20.0), 0.0)
    probes, now = [], 0.0
    for _ in range(700):                             # 70 s; the competitor never leaves
        was_probing = governor.probing
        now += STEP_S
        share = 0.5 if governor.threads == 2 else 0.0
        governor.observe(STEP_S, STEP_S * governor.threads * share, now)
        if governor.probing and not was_probing:
            probes.append(now)
    gaps = [round(b - a) for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == [10, 20, 20]                  # 5 s, then 10, 20, 20 (the most) after each return
    assert governor.threads in (1, 2)


def test_a_probe_on_free_cores_keeps_the_thread() -> None:
    governor = ThreadGovernor(GovernorConfig(max_threads=2), 0.0)
    now = run(governor, 0.5, 0.5, 0.0)
    assert governor.threads == 1
    run(governor, 10.0, 0.0, now)                     # the competitor left
    assert governor.threads == 2 and not governor.probing


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="threads bounds"):
        ThreadGovernor(GovernorConfig(max_threads=1, min_threads=2), 0.0)


def cgroup(tmp_path: Path, proc_line: str, files: dict[str, str]) -> tuple[Path, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text(proc_line + "\n")
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "fs", proc


def test_a_cgroup_v2_quota_is_read(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, "0::/kubepods/pod1", {"kubepods/pod1/cpu.max": "150000 100000\n"})
    assert cgroup_cpu_limit(root, proc) == 1.5
    root, proc = cgroup(tmp_path / "b", "0::/", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root, proc) is None


def test_a_cgroup_v1_quota_is_read(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, "4:cpu,cpuacct:/docker/abc", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "100000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_limit(root, proc) == 1.0
    root, proc = cgroup(tmp_path / "b", "1:cpu:/", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_limit(root, proc) is None


def test_default_threads_stay_within_the_quota() -> None:
    assert default_threads(cpus=8, limit=None) == 8
    assert default_threads(cpus=8, limit=2.0) == 2
    assert default_threads(cpus=8, limit=1.5) == 1
    assert default_threads(cpus=2, limit=0.5) == 1
    assert default_threads(cpus=2, limit=4.0) == 2


def test_the_wait_clock_sums_run_delay_and_throttling(tmp_path: Path) -> None:
    tasks = tmp_path / "task"
    for tid, delay_ns in ((1, 2_000_000_000), (2, 500_000_000)):
        (tasks / str(tid)).mkdir(parents=True)
        (tasks / str(tid) / "schedstat").write_text(f"123 {delay_ns} 7\n")
    root, proc = cgroup(tmp_path, "0::/", {"cpu.stat": "usage_usec 5\nnr_throttled 3\nthrottled_usec 250000\n"})
    clock = WaitClock(tasks, root, proc)
    assert clock.available() and clock.waited_s() == pytest.approx(2.75)
    assert WaitClock(tmp_path / "none", root, proc).available() is False


def test_this_machines_wait_clock_reads() -> None:
    clock = WaitClock()
    if clock.available():
        assert clock.waited_s() >= 0.0


class FakeClock:
    def __init__(self) -> None:
        self.waited = 0.0

    def waited_s(self) -> float:
        return self.waited


def test_the_pacer_samples_and_sets_the_count() -> None:
    now = [0.0]
    applied: list[int] = []
    clock = FakeClock()
    pacer = ThreadPacer(ThreadGovernor(GovernorConfig(max_threads=2), 0.0), clock, sample_s=0.05,
                        now=lambda: now[0], set_threads=applied.append)
    pacer.start()
    assert applied == [2]
    for _ in range(3):                               # faster than the sampling: nothing read
        now[0] += 0.01
        pacer.after_step()
    for _ in range(12):                              # 0.6 s at 2 threads, half of it waited
        now[0] += 0.05
        clock.waited += 0.05
        pacer.after_step()
    assert applied == [2, 1] and pacer.changes == 1
