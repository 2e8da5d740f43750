"""The thread governor applied to the engine's steps (CPU_THREAD_POLICY=adaptive): called on the
engine's thread after each step with its decode rows and wall time, it reads how long the process
waited for a CPU since its last reading (cpu_share.WaitClock: at most every `sample_s`, ~0.06 ms a reading with ~26 threads), asks the
governor (thread_governor.py) and sets the engine thread's OpenMP team size, which torch's
kernels and the C kernels (they pass torch.get_num_threads()) use from the next step on; called
before each step with whether it is decode-only, it sets the count the governor gives that kind
of step (a trial's count applies to decode-only steps alone)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from services.worker.engine.cpu.cpu_share import IdleClock, WaitClock
from services.worker.engine.cpu.thread_governor import ThreadGovernor

log = logging.getLogger(__name__)


class ThreadPacer:
    def __init__(self, governor: ThreadGovernor, clock: WaitClock, sample_s: float = 0.05,
                 now: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 idle: IdleClock | None = None) -> None:
        self.governor = governor
        self._clock = clock
        self._idle = idle               # the allowed CPUs' idle time (None: not read, never counted)
        self._sample_s = sample_s
        self._now = now
        self._set_threads = set_threads
        self._read_at = now()
        self._waited = clock.waited_s()
        self._idled = idle.idle_s() if idle is not None else 0.0
        self._decodes: list[tuple[int, float]] = []
        self._applied = governor.threads
        self.changes = 0

    def start(self) -> None:
        """Sets the governor's first count (call on the engine's thread)."""
        self._apply(self.governor.threads)

    def before_step(self, decode_only: bool) -> None:
        """Before a step on the engine's thread: the count for a step of its kind."""
        threads = self.governor.threads_for(decode_only)
        if threads != self._applied:
            self._apply(threads)

    def _apply(self, threads: int) -> None:
        self._set_threads(threads)
        self._applied = threads

    def after_step(self, decode_rows: int, step_s: float) -> None:
        """After a step on the engine's thread: its rows when every one was a decode (else 0)
        and its wall time."""
        if decode_rows:
            self._decodes.append((decode_rows, step_s))
        now = self._now()
        if now - self._read_at < self._sample_s:
            return
        waited = self._clock.waited_s()
        idled = self._idle.idle_s() if self._idle is not None else 0.0
        governor = self.governor
        before, was_trial = governor.threads, governor.in_trial
        threads = governor.observe(now - self._read_at, self._decodes, waited - self._waited, now, idled - self._idled)
        self._read_at, self._waited, self._idled, self._decodes = now, waited, idled, []
        if threads != before:
            self.changes += 1
        if threads != self._applied:
            self._apply(threads)
        if was_trial and not governor.in_trial:
            self._log_outcome(threads)
        elif threads != before and governor.confirming:
            log.info("engine threads %d -> %d to confirm the trial (its steps cost %.2fx these)",
                     before, threads, governor.last_relative)
        elif threads > before and not governor.in_trial:
            log.info("engine threads %d -> %d: the CPUs sat idle (%.1f of a CPU) while the threads did not wait",
                     before, threads, governor.last_idle)
        elif threads != before and governor.in_trial:
            log.info("engine threads %d -> %d on trial (the threads waited for a CPU %.0f%% of their time)",
                     before, threads, 100 * governor.last_share)

    def _log_outcome(self, threads: int) -> None:
        governor = self.governor
        relative = governor.last_relative
        cost = f"{relative:.2f}x" if relative is not None else "not comparable"
        if governor.last_kept and threads < governor.config.max_threads:
            # An operator's signal: another process (or the CPU quota) takes the cores.
            log.warning("engine threads: %d of %d kept, their steps cost less than with more (%s; another "
                        "process or the CPU quota takes the cores)", threads, governor.config.max_threads, cost)
        elif governor.last_kept:
            log.info("engine threads: %d again, the cores are free (steps %s)", threads, cost)
        else:
            log.info("engine threads: %d, the trial was not faster (steps %s)", threads, cost)
