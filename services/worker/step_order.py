"""Runs a worker's steps in the order the scheduler planned them.

With async scheduling the scheduler sends step N+1 while step N still runs, so
two Step calls can be in the worker at once; each names the step it must
follow (`after_step_id`, 0 when none is in flight). A step waits until its
predecessor has finished, successfully or not; the caller's deadline bounds
the wait if the predecessor never arrives.

Step ids count per scheduler registration (the step's epoch). A step of a
larger epoch starts the order afresh, and lets every step still waiting from
an earlier one go on at once (the engine refuses those); a step of an earlier
epoch waits for nothing and marks nothing finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class StepOrder:
    def __init__(self) -> None:
        self._epoch = 0
        self._last_finished = 0
        self._waiting_for: dict[int, asyncio.Event] = {}   # predecessor step id -> its successor's wake-up

    @asynccontextmanager
    async def turn(self, step_id: int, after_step_id: int, epoch: int = 0) -> AsyncIterator[None]:
        self._enter(epoch)
        if epoch == self._epoch and after_step_id and self._last_finished != after_step_id:
            await self._waiting_for.setdefault(after_step_id, asyncio.Event()).wait()
        try:
            yield
        finally:
            if epoch == self._epoch:
                self._last_finished = step_id
                finished = self._waiting_for.pop(step_id, None)
                if finished is not None:
                    finished.set()

    def _enter(self, epoch: int) -> None:
        """A larger epoch: the order starts again, and what waited in the old one goes on."""
        if epoch <= self._epoch:
            return
        self._epoch, self._last_finished = epoch, 0
        waiting, self._waiting_for = self._waiting_for, {}
        for wake in waiting.values():
            wake.set()
