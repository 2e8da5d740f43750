"""Runs a worker's steps in the order the scheduler planned them.

With async scheduling the scheduler sends step N+1 while step N still runs, so
two Step calls can be in the worker at once; each names the step it must
follow (`after_step_id`, 0 when none is in flight). A step waits until its
predecessor has finished, successfully or not; the caller's deadline bounds
the wait if the predecessor never arrives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class StepOrder:
    def __init__(self) -> None:
        self._last_finished = 0
        self._waiting_for: dict[int, asyncio.Event] = {}   # predecessor step id -> its successor's wake-up

    @asynccontextmanager
    async def turn(self, step_id: int, after_step_id: int) -> AsyncIterator[None]:
        if after_step_id and self._last_finished != after_step_id:
            await self._waiting_for.setdefault(after_step_id, asyncio.Event()).wait()
        try:
            yield
        finally:
            self._last_finished = step_id
            finished = self._waiting_for.pop(step_id, None)
            if finished is not None:
                finished.set()
