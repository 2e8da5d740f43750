"""A token bucket: `rate_per_s` tokens a second up to `burst` saved; each
take spends one or more, or says how long until it could. Pure, with the
clock injected."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not rate_per_s > 0 or burst < 1:
            raise ValueError("a token bucket needs rate_per_s > 0 and burst >= 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._updated = clock()

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._updated)  # a clock that steps back adds nothing
        self._tokens = min(float(self.burst), self._tokens + elapsed * self.rate_per_s)
        self._updated = now

    def take(self, count: int = 1) -> float:
        """Spends `count` tokens and returns 0, or spends none and returns the
        seconds until `count` tokens will be there (inf if never: more than
        the burst)."""
        self._refill()
        if self._tokens >= count:
            self._tokens -= count
            return 0.0
        if count > self.burst:
            return float("inf")
        return (count - self._tokens) / self.rate_per_s

    @property
    def tokens(self) -> float:
        self._refill()
        return self._tokens
