"""The engine's thread count on shared cores (engine/cpu/thread_governor.py, cpu_share.py,
thread_pacer.py): a trial at one thread fewer when the threads wait for a CPU, kept only when its
steps cost less, trials back up and again with backoff, the cgroup quota read as Kubernetes sets it (v1 and v2), the waiting read from the
kernel's per-thread statistics, and the pacer setting the count on the engine's thread."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.worker.engine.cpu.cpu_share import IdleClock, WaitClock, cgroup_cpu_limit, default_threads, threads_within
from services.worker.engine.cpu.thread_governor import GovernorConfig, ThreadGovernor, relative_cost
from services.worker.engine.cpu.thread_pacer import ThreadPacer

STEP_S = 0.1


class Machine:
    """Steps of one token on a simulated machine: `cost_ms[threads]` per step, and the waiting
    share the threads see at each count."""

    def __init__(self, governor: ThreadGovernor, cost_ms: dict[int, float], share: dict[int, float]) -> None:
        self.governor, self.cost_ms, self.share, self.now = governor, cost_ms, share, 0.0
        self.rows = 1
        self.trials: list[tuple[float, int]] = []

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            threads = self.governor.threads
            wall = self.cost_ms[threads] / 1000
            self.now += wall
            was_trial = self.governor.in_trial
            self.governor.observe(wall, [(self.rows, wall)], wall * threads * self.share[threads], self.now)
            if self.governor.in_trial and not was_trial:
                self.trials.append((round(self.now, 1), self.governor.threads))


def test_idle_cores_keep_every_thread() -> None:
    machine = Machine(ThreadGovernor(GovernorConfig(max_threads=2), 0.0), {2: 12, 1: 25}, {2: 0.01, 1: 0.0})
    machine.run(30.0)
    assert machine.governor.threads == 2 and machine.trials == []


def test_a_collapse_moves_to_fewer_threads_within_a_second() -> None:
    machine = Machine(ThreadGovernor(GovernorConfig(max_threads=2), 0.0), {2: 400, 1: 25}, {2: 0.3, 1: 0.0})
    machine.run(1.2)
    assert machine.governor.threads == 1 and not machine.governor.in_trial
    machine.run(60.0)
    assert machine.governor.threads in (1, 2)
    ups = [at for at, threads in machine.trials if threads == 2]
    # 5 s after, then backing off (each trial at 400 ms a step lasts the two steps it compares)
    assert [round(b - a) for a, b in zip(ups, ups[1:])] == [11, 21]


def test_waiting_that_costs_nothing_keeps_every_thread() -> None:
    """The stack's own gateway and scheduler on the same cores: the threads wait a fifth of
    their time, but two still step twice as fast as one, so the trials go back."""
    machine = Machine(ThreadGovernor(GovernorConfig(max_threads=2), 0.0), {2: 12, 1: 24}, {2: 0.25, 1: 0.0})
    machine.run(120.0)
    assert machine.governor.threads == 2 or machine.governor.in_trial
    downs = [at for at, threads in machine.trials if threads == 1]
    assert [round(b - a) for a, b in zip(downs, downs[1:])] == [5, 10, 21, 41]   # backing off
    assert len(downs) * 0.3 / 120.0 < 0.02           # under 2 % of the time on trials


def test_the_threads_come_back_when_the_competitor_leaves() -> None:
    governor = ThreadGovernor(GovernorConfig(max_threads=2), 0.0)
    Machine(governor, {2: 400, 1: 25}, {2: 0.3, 1: 0.0}).run(2.0)
    assert governor.threads == 1
    free = Machine(governor, {2: 12, 1: 25}, {2: 0.0, 1: 0.0})
    free.now = 2.0
    free.run(10.0)
    assert governor.threads == 2 and not governor.in_trial


def test_more_threads_step_down_one_at_a_time_to_the_floor() -> None:
    governor = ThreadGovernor(GovernorConfig(max_threads=4), 0.0)
    Machine(governor, {4: 300, 3: 200, 2: 100, 1: 50}, {4: 0.5, 3: 0.5, 2: 0.5, 1: 0.5}).run(4.0)
    assert governor.threads == 1                      # and never below min_threads


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
    assert threads_within(8, None) == 8
    assert threads_within(8, 2.0) == 2
    assert threads_within(8, 1.5) == 1
    assert threads_within(2, 0.5) == 1
    assert threads_within(2, 4.0) == 2
    assert 1 <= default_threads() <= len(os.sched_getaffinity(0))


def test_the_wait_clock_sums_run_delay_and_throttling(tmp_path: Path) -> None:
    tasks = tmp_path / "task"
    for tid, delay_ns in ((1, 2_000_000_000), (2, 500_000_000)):
        (tasks / str(tid)).mkdir(parents=True)
        (tasks / str(tid) / "schedstat").write_text(f"123 {delay_ns} 7\n")
    root, proc = cgroup(tmp_path, "0::/", {"cpu.stat": "usage_usec 5\nnr_throttled 3\nthrottled_usec 250000\n"})
    clock = WaitClock(tasks, root, proc)
    assert clock.available() and clock.waited_s() == pytest.approx(2.75)
    assert WaitClock(tmp_path / "none", root, proc).available() is False


def test_the_wait_clock_follows_threads_that_come_and_go(tmp_path: Path) -> None:
    """Each thread's file stays open between readings: a new value is read again, a thread gone
    is dropped (and its file closed), a new one counted."""
    import shutil
    tasks = tmp_path / "task"
    for tid in (1, 2):
        (tasks / str(tid)).mkdir(parents=True)
        (tasks / str(tid) / "schedstat").write_text("1 1000000000 1\n")
    root, proc = cgroup(tmp_path, "0::/", {"cpu.stat": "usage_usec 5\n"})
    clock = WaitClock(tasks, root, proc)
    assert clock.waited_s() == pytest.approx(2.0)
    (tasks / "1" / "schedstat").write_text("1 3000000000 1\n")
    assert clock.waited_s() == pytest.approx(4.0)
    shutil.rmtree(tasks / "2")
    (tasks / "3").mkdir()
    (tasks / "3" / "schedstat").write_text("1 500000000 1\n")
    assert clock.waited_s() == pytest.approx(3.5)
    assert sorted(clock._open) == ["1", "3"]
    clock.close()
    assert clock._open == {}


def test_this_machines_wait_clock_reads() -> None:
    clock = WaitClock()
    if clock.available():
        assert clock.waited_s() >= 0.0


class FakeClock:
    def __init__(self) -> None:
        self.waited = 0.0

    def waited_s(self) -> float:
        return self.waited


def _pacer() -> tuple[ThreadPacer, list[float], FakeClock, list[int]]:
    """A started pacer of two threads on a fake clock: (pacer, now, wait clock, counts applied)."""
    now: list[float] = [0.0]
    applied: list[int] = []
    clock = FakeClock()
    pacer = ThreadPacer(ThreadGovernor(GovernorConfig(max_threads=2), 0.0), clock, sample_s=0.05,
                        now=lambda: now[0], set_threads=applied.append)
    pacer.start()
    return pacer, now, clock, applied


def test_the_pacer_samples_and_sets_the_count() -> None:
    pacer, now, clock, applied = _pacer()
    assert applied == [2]
    for _ in range(3):                               # faster than the sampling: nothing read
        now[0] += 0.01
        pacer.after_step(1, 0.01)
    for _ in range(12):                              # 0.6 s of 50 ms decodes at 2 threads, half of it waited
        now[0] += 0.05
        clock.waited += 0.05
        pacer.after_step(1, 0.05)
    assert applied == [2, 1] and pacer.governor.in_trial     # a trial at one thread
    for _ in range(8):                               # 0.4 s of decodes 5 times cheaper
        now[0] += 0.05
        for _ in range(5):
            pacer.after_step(1, 0.01)
    assert applied == [2, 1] and not pacer.governor.in_trial and pacer.governor.threads == 1


def test_a_trial_is_judged_against_steps_of_the_same_rows() -> None:
    """A prefill chunk, or a step of other rows, is no evidence: only decode steps of a row
    count both sides saw are compared, and a trial with none goes back."""
    steady = {8: [0.08, 2], 32: [0.4, 2]}           # 40 ms at 8 rows, 200 ms at 32
    assert relative_cost({8: [0.02, 1]}, steady) == pytest.approx(0.5)
    assert relative_cost({8: [0.02, 1], 32: [0.6, 3]}, steady) == pytest.approx((0.5 + 3 * 1.0) / 4)
    assert relative_cost({16: [0.01, 1]}, steady) is None
    governor = ThreadGovernor(GovernorConfig(max_threads=2), 0.0)
    governor.observe(0.6, [(32, 0.2)] * 3, 0.6, 0.6)        # waited half: a trial at one thread
    assert governor.in_trial and governor.threads == 1
    governor.observe(0.4, [], 0.0, 1.0)                      # prefill steps only: nothing to compare yet
    assert governor.in_trial and governor.threads == 1
    governor.observe(0.3, [(32, 0.35)], 0.0, 1.3)            # one decode of the same rows: no evidence yet
    assert governor.in_trial
    governor.observe(0.35, [(32, 0.35)], 0.0, 1.65)          # two: 1.75x as long
    assert governor.threads == 2 and not governor.in_trial
    governor = ThreadGovernor(GovernorConfig(max_threads=2), 0.0)
    governor.observe(0.6, [(32, 0.2)] * 3, 0.6, 0.6)
    governor.observe(0.5, [], 0.0, 1.1)
    assert governor.in_trial
    governor.observe(0.6, [(16, 0.1)], 0.0, 1.7)             # over a second and still nothing to compare: back
    assert governor.threads == 2 and not governor.in_trial


def test_one_step_is_no_evidence() -> None:
    """The warm-up's last 1-row decode, slowed by a burst of arrivals, starts no trial: one
    step cannot say which count is faster."""
    governor = ThreadGovernor(GovernorConfig(max_threads=2), 0.0)
    governor.observe(0.6, [(1, 0.041)], 0.4, 0.6)
    assert governor.threads == 2 and not governor.in_trial


def test_a_trial_is_judged_against_the_window_right_before_it_only() -> None:
    """At 32 streams on idle cores: the warm-up's few slow decode steps, then a burst of
    prefill steps while the gateway tokenizes 32 prompts (the threads wait). No trial may be
    judged against the warm-up's steps, so none starts until a window has decode steps again;
    and one that starts then is judged against that window's steps."""
    governor = ThreadGovernor(GovernorConfig(max_threads=2), 0.0)
    governor.observe(0.6, [(1, 0.03)] * 20, 0.0, 0.6)        # warm-up: 1-row decodes at 30 ms
    governor.observe(1.4, [], 1.9, 2.0)                      # a prefill step, waiting 68 %
    assert governor.threads == 2 and not governor.in_trial
    governor.observe(1.4, [], 1.9, 3.4)
    assert governor.threads == 2 and not governor.in_trial
    governor.observe(0.6, [(32, 0.15)] * 4, 0.4, 4.0)        # decodes again, still waiting a third
    assert governor.in_trial and governor.threads == 1
    governor.observe(0.3, [(1, 0.012)], 0.0, 4.3)            # a 1-row decode: the warm-up's count, not the window's
    assert governor.in_trial
    governor.observe(0.52, [(32, 0.26)] * 2, 0.0, 5.1)       # 32 rows at one thread: slower
    assert governor.threads == 2 and not governor.in_trial


def test_a_load_that_ends_during_a_trial_keeps_every_thread() -> None:
    """At the served stack's switch from one stream to 32: the window before the trial held
    1-row decodes slowed by the gateway tokenizing the arriving prompts, the trial's steps at
    one thread came after the burst and look cheaper (0.7x). Back at two threads for a
    confirmation, the burst over, two threads are faster: the trial goes back."""
    governor = ThreadGovernor(GovernorConfig(max_threads=2), 0.0)
    governor.observe(0.6, [(1, 0.02)] * 30, 0.4, 0.6)        # 20 ms steps, waiting a third: a trial
    assert governor.in_trial and governor.threads == 1
    governor.observe(0.32, [(1, 0.014)] * 23, 0.0, 0.92)      # 14 ms at one thread: 0.7x, not sure
    assert governor.confirming and governor.threads == 2
    governor.observe(0.32, [(1, 0.012)] * 26, 0.0, 1.24)      # the burst is over: 12 ms at two
    assert governor.threads == 2 and not governor.in_trial and not governor.last_kept
    assert governor.last_relative == pytest.approx(14 / 12)


def test_contention_that_lasts_is_kept_after_its_confirmation() -> None:
    """A milder contention (one thread 0.73x the cost of two, not the collapse kept at once)
    is confirmed by a window back at two threads and kept."""
    machine = Machine(ThreadGovernor(GovernorConfig(max_threads=2), 0.0), {2: 30, 1: 22}, {2: 0.3, 1: 0.0})
    machine.run(2.0)
    assert machine.governor.threads == 1 and not machine.governor.in_trial and machine.governor.last_kept
    assert machine.trials == [(0.5, 1)]                       # the trial and its confirmation, once


def test_a_collapse_is_kept_without_a_confirmation() -> None:
    governor = ThreadGovernor(GovernorConfig(max_threads=2), 0.0)
    governor.observe(0.6, [(1, 0.2)] * 3, 0.6, 0.6)          # 200 ms steps: a busy process on a core
    governor.observe(0.3, [(1, 0.025)] * 12, 0.0, 0.9)        # 25 ms at one thread: 0.125x
    assert governor.threads == 1 and not governor.in_trial and governor.last_kept


def test_a_confirmation_with_nothing_to_compare_goes_back() -> None:
    """Prefill steps only, back at two threads: the trial is not kept (one thread fewer through
    a long prefill, undisproved, is what cost a third of a c32 run)."""
    governor = ThreadGovernor(GovernorConfig(max_threads=2), 0.0)
    governor.observe(0.6, [(1, 0.02)] * 30, 0.4, 0.6)
    governor.observe(0.32, [(1, 0.014)] * 23, 0.0, 0.92)
    assert governor.confirming
    governor.observe(0.6, [], 0.0, 1.52)
    assert governor.confirming                                # nothing comparable yet: on, up to a second
    governor.observe(0.5, [], 0.0, 2.02)
    assert governor.threads == 2 and not governor.in_trial and not governor.last_kept


def test_a_trial_applies_to_decode_steps_alone() -> None:
    """A trial down started by a new load's burst of arrivals must not run the prefill steps
    that follow (seconds each, never compared) at one thread: steps with prefill rows run at the
    larger count during a trial, down or up; outside trials every step runs at the count."""
    governor = ThreadGovernor(GovernorConfig(max_threads=2), 0.0)
    assert governor.threads_for(True) == governor.threads_for(False) == 2
    governor.observe(0.6, [(1, 0.02)] * 30, 0.4, 0.6)        # waiting a third: a trial at one thread
    assert governor.in_trial and governor.threads == 1
    assert governor.threads_for(True) == 1 and governor.threads_for(False) == 2
    governor.observe(0.3, [(1, 0.005)] * 60, 0.0, 0.9)        # a collapse: one thread kept
    assert not governor.in_trial and governor.threads == 1
    assert governor.threads_for(True) == governor.threads_for(False) == 1
    governor.observe(6.0, [(1, 0.02)] * 300, 0.0, 6.9)        # retry_s later: a trial back up
    assert governor.in_trial and governor.threads == 2
    assert governor.threads_for(True) == governor.threads_for(False) == 2


def test_the_pacer_runs_prefill_steps_at_the_count_a_trial_left() -> None:
    pacer, now, clock, applied = _pacer()
    for _ in range(12):                              # 0.6 s of decodes, half of it waited: a trial
        pacer.before_step(True)
        now[0] += 0.05
        clock.waited += 0.05
        pacer.after_step(1, 0.05)
    assert pacer.governor.in_trial and applied == [2, 1]
    pacer.before_step(False)                         # a prefill step: two threads
    now[0] += 0.05
    pacer.after_step(0, 0.05)
    pacer.before_step(True)                          # a decode step: the trial's one
    assert applied == [2, 1, 2, 1]
    pacer.before_step(True)                          # no change, no call
    assert applied == [2, 1, 2, 1]


def _kept_at_one_thread() -> ThreadGovernor:
    """A collapse (a busy process on the other core) kept at one thread at t = 0.9 s."""
    governor = ThreadGovernor(GovernorConfig(max_threads=2), 0.0)
    governor.observe(0.6, [(1, 0.2)] * 3, 0.6, 0.6)
    governor.observe(0.3, [(1, 0.025)] * 12, 0.0, 0.9)
    assert governor.threads == 1 and not governor.in_trial
    return governor


def test_idle_cpus_bring_the_thread_back_through_a_long_prefill() -> None:
    """The competitor is gone and the load is prefill steps, seconds each, with no decode step
    a trial back up could be judged on: a window whose other CPU sat idle while the thread did
    not wait brings the thread back at once (once the wait after the last change is over)."""
    governor = _kept_at_one_thread()
    assert governor.observe(1.0, [], 0.0, 1.9, idle_s=0.9) == 1      # idle, but within retry_s of the change
    assert governor.observe(4.0, [], 0.0, 5.9, idle_s=3.8) == 2      # idle most of a CPU: back up
    assert not governor.in_trial and governor.last_idle == pytest.approx(0.95)


def test_a_busy_neighbour_or_a_quota_keeps_the_thread_down() -> None:
    """With the busy process still on the other core no CPU sits idle; under a CPU quota the
    thread waits (throttled) even where other CPUs are idle: neither brings a thread back."""
    governor = _kept_at_one_thread()
    governor.observe(6.0, [], 0.0, 6.9, idle_s=0.1)                    # busy neighbour: 0.02 of a CPU idle
    assert governor.threads == 1
    governor = _kept_at_one_thread()
    governor.observe(6.0, [], 3.0, 6.9, idle_s=6.0)                    # throttled half the time
    assert governor.threads == 1


def test_the_idle_clock_sums_the_allowed_cpus(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 900 90 0 0 0 0 0\n"
                    "cpu0 5 0 5 300 30 0 0 0 0 0\n"
                    "cpu1 5 0 5 300 30 0 0 0 0 0\n"
                    "cpu2 0 0 0 300 30 0 0 0 0 0\n"
                    "intr 12345\nctxt 678\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert IdleClock(stat, cpus={0, 2}).idle_s() == pytest.approx(660 / tick)
    assert IdleClock(stat, cpus={1}).available()


def test_this_machines_idle_clock_reads() -> None:
    clock = IdleClock()
    assert clock.available() and clock.idle_s() >= 0.0
