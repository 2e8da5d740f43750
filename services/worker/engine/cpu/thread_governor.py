"""How many threads the engine's steps use when the cores are shared (CPU_THREAD_POLICY=adaptive).

A step on CPU is hundreds of parallel regions, each ending at a barrier that waits for the
team's slowest thread. When another process takes one of the cores, the thread that shares it
is descheduled for whole time slices, and every barrier waits them out: at one stream on two
cores, a decode step went from ~12 ms to ~400 ms. With one thread fewer than the cores that
are free there is no barrier to wait at, and the step costs what that many threads cost.

The signal is the time the process's threads spent runnable but waiting for a CPU (the kernel's
run delay, plus the time a cgroup CPU quota throttled it), as a share of the threads' time in
the window's steps:

    share = waited / (wall of the steps x threads)

    at n threads, a window (`window_s` of steps) with share >= `high`  -> n - 1 (down to `min_threads`)
    below the most, every `probe_after_s`  -> n + 1 for a short window (`probe_s`, a probe):
        its share < `high`: keep it (the competitor left); else back, and the next probe
        waits twice as long (up to `probe_max_s`)

Windows are measured in time, not steps, so that steps slowed down by the contention itself
(hundreds of ms each) are judged as soon as quick ones.

Pure: it is given the wall time of the steps since its last call and the waiting measured
across them, and answers the thread count to use from then on; cpu_share.py measures,
thread_pacer.py applies.
Invariant: min_threads <= threads <= max_threads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GovernorConfig:
    max_threads: int
    min_threads: int = 1
    high: float = 0.2                   # the waiting share that means the cores are taken
    window_s: float = 0.5               # wall time of steps per judgement at a steady count
    probe_s: float = 0.2                # wall time a probe at one thread more lasts (1 call at least)
    probe_after_s: float = 5.0          # first wait before probing up again
    probe_max_s: float = 60.0


@dataclass
class _Window:
    steps: int = 0
    wall_s: float = 0.0
    waited_s: float = 0.0

    def share(self, threads: int) -> float:
        return self.waited_s / (self.wall_s * threads) if self.wall_s > 0 else 0.0


class ThreadGovernor:
    """The thread count for the next step, from what the last steps waited (module docstring)."""

    def __init__(self, config: GovernorConfig, now_s: float) -> None:
        if not 1 <= config.min_threads <= config.max_threads:
            raise ValueError(f"threads bounds {config.min_threads}..{config.max_threads} are not 1 <= min <= max")
        self.config = config
        self.threads = config.max_threads
        self._window = _Window()
        self._probing_from: int | None = None      # the count a probe returns to if it fails
        self._probe_wait_s = config.probe_after_s
        self._changed_at_s = now_s
        self.last_share = 0.0                       # the last judged window's waiting share

    @property
    def probing(self) -> bool:
        return self._probing_from is not None

    def observe(self, wall_s: float, waited_s: float, now_s: float) -> int:
        """The steps since the last call: their wall time and the process's waiting over it.
        Returns the count to use from the next step on (the same one, or a change)."""
        window = self._window
        window.steps += 1
        window.wall_s += max(wall_s, 0.0)
        window.waited_s += max(waited_s, 0.0)
        if self.probing:
            if window.wall_s >= self.config.probe_s:
                self.last_share = window.share(self.threads)
                self._end_probe(self.last_share, now_s)
            return self.threads
        if window.wall_s >= self.config.window_s:
            share = self.last_share = window.share(self.threads)
            self._window = _Window()
            if share >= self.config.high and self.threads > self.config.min_threads:
                self._set(self.threads - 1, now_s)
                return self.threads
        if self.threads < self.config.max_threads and now_s - self._changed_at_s >= self._probe_wait_s:
            self._probing_from = self.threads
            self._set(self.threads + 1, now_s)
        return self.threads

    def _end_probe(self, share: float, now_s: float) -> None:
        returned_to = self._probing_from
        self._probing_from = None
        if share >= self.config.high and returned_to is not None:
            self._probe_wait_s = min(self._probe_wait_s * 2, self.config.probe_max_s)
            self._set(returned_to, now_s)
        else:
            self._probe_wait_s = self.config.probe_after_s
            self._window = _Window()

    def _set(self, threads: int, now_s: float) -> None:
        self.threads = threads
        self._changed_at_s = now_s
        self._window = _Window()
