"""A worker left with nothing running hands back what its wide steps freed once no step has
come for `delay_s` (HOST_MEMORY_QUIET_RELEASE_S), on the engine's thread.

The release (malloc_trim, Engine.release_wide_step_memory) takes ~7-10 ms after a 1.5k-token
prefill and holds the malloc lock all the worker's threads allocate under (one arena,
host/process_start.py). Run right after the step that left the worker quiet, it overlapped the
next request's way in: a prompt sharing the prefix just prefilled, sent as soon as the first
one's token came back, reached the worker's step 1-5 ms late and ran ~1 ms slower (its buffers
faulted in again), ~3 ms of a ~24 ms first token. Waiting for a quiet spell lets such a
follow-up run first; a step that arrives meanwhile cancels the wait, and the worker's next
quiet point starts it again. The peak is the burst's either way (step/wide_release.py).

Invariant: at most one release armed; none while a step has been received and not run to the
end; a delay of 0 releases right after the quiet step, while its reply goes back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class QuietRelease:
    def __init__(self, delay_s: float, holds: Callable[[], bool],
                 release: Callable[[], Awaitable[object]]) -> None:
        """`holds`: whether a wide step's memory is held (read off the engine's thread, between
        steps); `release`: the release, run on the engine's thread."""
        self._delay_s = delay_s
        self._holds = holds
        self._release = release
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self.releases = 0           # releases that handed something back

    @property
    def armed(self) -> bool:
        return self._timer is not None

    def step_received(self) -> None:
        """A step came: nothing is released before the worker is quiet again."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def after_step(self, running: int, steps_waiting: int) -> None:
        """After a step ran: with no sequence running, no other step received and a wide
        step's memory held, the release starts after the delay (now with none)."""
        if running or steps_waiting or not self._holds():
            return
        self.step_received()
        if self._delay_s <= 0:
            self._start()
        else:
            self._timer = asyncio.get_running_loop().call_later(self._delay_s, self._start)

    def close(self) -> None:
        self.step_received()

    def _start(self) -> None:
        self._timer = None
        task = asyncio.ensure_future(self._release())
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        if task.exception() is not None:
            log.warning("memory release after a step failed", extra={"error": repr(task.exception())})
        elif task.result():
            self.releases += 1      # something was handed back
