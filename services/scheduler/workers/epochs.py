"""Registration epochs. Each registration of a worker begins a new epoch, larger
than every epoch before it, in this scheduler process or an earlier one: they are
wall-clock nanoseconds, moved on by one when two registrations would share one,
and past the epoch the registering worker serves (a clock behind the previous
scheduler's cannot go back).
Every Step carries its worker's epoch. A worker that sees a larger epoch frees
every sequence it still holds (the scheduler that planned them is gone, or
dropped the worker and resumed them elsewhere) and refuses steps of a smaller
one, so a scheduler restart leaks no KV block."""

from __future__ import annotations

import time
from collections.abc import Callable


class EpochClock:
    def __init__(self, now_ns: Callable[[], int] = time.time_ns) -> None:
        self._now_ns = now_ns
        self._last = 0

    def next(self, after: int = 0) -> int:
        """A new epoch, larger than every one given before and than `after` (the one
        the registering worker serves: an earlier scheduler's clock may have been ahead)."""
        self._last = max(self._last + 1, after + 1, self._now_ns())
        return self._last
