"""An idle worker hands the memory its steps freed back to the system (CPU).

The engine keeps what a step frees for the next one (glibc told to keep freed memory,
cpu/host_memory.py): a step allocates the same large buffers again, and taking them back from
the kernel each time cost page faults on every step. So the worker keeps what its decode steps
freed (a wide step hands its own back, HOST_MEMORY_RELEASE_ROWS in engine.py). Once no step has
run for `delay_s` (HOST_MEMORY_IDLE_RELEASE_S), the freed memory goes back (malloc_trim), once
per idle spell, on the engine's thread between steps; the next burst's first steps fault their
buffers in again (a few ms).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class IdleRelease:
    """When the freed memory goes back: after each step `stepped` arms it; `release_if_idle`
    (on the engine's thread, so no step runs meanwhile) releases once the last step is
    `delay_s` old, and disarms until the next step."""

    def __init__(self, delay_s: float, release: Callable[[], object],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._delay_s = delay_s
        self._release = release
        self._clock = clock
        self._last_step = clock()
        self._armed = False
        self.releases = 0

    def stepped(self) -> None:
        self._last_step = self._clock()
        self._armed = True

    def due(self) -> bool:
        return self._armed and self._clock() - self._last_step >= self._delay_s

    def release_if_idle(self) -> bool:
        if not self.due():
            return False
        self._release()
        self._armed = False
        self.releases += 1
        return True

    async def run(self, on_engine_thread: Callable[[Callable[[], bool]], Awaitable[bool]],
                  stop: asyncio.Event) -> None:
        """Checks every `delay_s / 4` (at least every second) until `stop` is set; a due
        release runs through `on_engine_thread`."""
        poll_s = min(max(self._delay_s / 4, 0.05), 1.0)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except asyncio.TimeoutError:
                pass
            if not stop.is_set() and self.due():
                await on_engine_thread(self.release_if_idle)
