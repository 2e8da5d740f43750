"""A refilling budget: `rate_per_s` units a second up to `capacity` saved. A
take spends units only when they are there (or says how long until they will
be); a charge spends them regardless, and may leave the budget in debt, which
the refill pays off first. Pure, with the clock injected."""

from __future__ import annotations

import math
from collections.abc import Callable


class Budget:
    def __init__(self, rate_per_s: float, capacity: float, clock: Callable[[], float]) -> None:
        if not rate_per_s > 0 or not capacity >= 1:
            raise ValueError("a budget needs rate_per_s > 0 and capacity >= 1")
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self._clock = clock
        self._level = float(capacity)
        self._updated = clock()

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._updated)  # a clock that steps back adds nothing
        self._level = min(self.capacity, self._level + elapsed * self.rate_per_s)
        self._updated = now

    def wait_s(self, count: float) -> float:
        """Seconds until `count` units are there (0: now; inf: never, more than the capacity)."""
        self._refill()
        if self._level >= count:
            return 0.0
        if count > self.capacity:
            return math.inf
        return (count - self._level) / self.rate_per_s

    def take(self, count: float = 1) -> float:
        """Spends `count` units and returns 0, or spends none and returns wait_s(count)."""
        wait = self.wait_s(count)
        if wait == 0.0:
            self._level -= count
        return wait

    def charge(self, count: float) -> None:
        """Spends `count` units, into debt if need be."""
        self._refill()
        self._level -= count

    def reshape(self, rate_per_s: float, capacity: float) -> None:
        """New figures; what is saved stays, up to the new capacity."""
        self._refill()
        self.rate_per_s, self.capacity = rate_per_s, capacity
        self._level = min(self._level, float(capacity))

    @property
    def level(self) -> float:
        self._refill()
        return self._level

    @property
    def full(self) -> bool:
        return self.level >= self.capacity
