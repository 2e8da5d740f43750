"""How the index reaches Redis when Redis is slow, down or restarted.

Every connect and every reply has a deadline (REDIS_SOCKET_TIMEOUT_S), so a
black-holed Redis fails a call instead of holding it. A dropped connection is
tried once more on a new one (Redis restarted); a timeout is not retried.
After a failure, calls fail at once for PAUSE_AFTER_FAILURE_S instead of each
waiting out its own deadline: lookups answer UNAVAILABLE at once and the
scheduler routes by load; publishes fail and the workers keep their events
for later. The first call after the pause tries Redis again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

log = logging.getLogger(__name__)

T = TypeVar("T")
PAUSE_AFTER_FAILURE_S = 1.0


def redis_client(url: str, socket_timeout_s: float, password: str = "") -> redis.Redis:
    """A client whose calls end within about twice `socket_timeout_s` (connect,
    then reply); `password` (AUTH) unless empty: the URL's then, if any."""
    extra = {"password": password} if password else {}
    return redis.from_url(url, decode_responses=True, socket_timeout=socket_timeout_s, **extra,
                          socket_connect_timeout=socket_timeout_s,
                          retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)))


class RedisPaused(redis.ConnectionError):
    """Redis failed a moment ago; it is not asked again until the pause ends."""


class RedisGuard:
    def __init__(self, pause_s: float = PAUSE_AFTER_FAILURE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pause_s = pause_s
        self._clock = clock
        self._paused_until = 0.0
        self._failing = False
        self._last_error = ""

    @property
    def failing(self) -> bool:
        """True from a failed call until the next one that succeeds."""
        return self._failing

    async def call(self, work: Callable[[], Awaitable[T]]) -> T:
        """Runs one Redis call, or raises RedisPaused during a pause."""
        if self._clock() < self._paused_until:
            raise RedisPaused(f"Redis failed recently ({self._last_error}); not retried yet")
        try:
            result = await work()
        except (redis.ConnectionError, redis.TimeoutError) as error:
            self._paused_until = self._clock() + self._pause_s
            self._last_error = str(error) or type(error).__name__
            if not self._failing:
                log.warning("Redis unreachable; index calls fail fast until it answers",
                            extra={"error": self._last_error, "pause_s": self._pause_s})
            self._failing = True
            raise
        if self._failing:
            log.info("Redis answers again")
            self._failing = False
        return result
