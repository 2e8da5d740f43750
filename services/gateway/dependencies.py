"""What the gateway knows of the services behind it: the last readiness probe
(the scheduler with its workers, and the kvcache index), shared by /ready,
/health, /stats and /metrics, and the dependency_up gauge it keeps.

The kvcache index is a routing hint: while it does not answer, serving goes
on and the gateway stays ready, but reports itself degraded. /ready always
probes; /stats and /metrics take a probe younger than max_age_s; /health
never waits on one (a liveness check must not hang on a black-holed
dependency): it reports the last and starts the next in the background.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client import Gauge

from services.gateway.requests.backend import Readiness, SchedulerBackend

DEPENDENCIES = ("scheduler", "kvcache")
MAX_AGE_S = 1.0


class DependencyMonitor:
    def __init__(self, backend: SchedulerBackend, gauge: Gauge, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._backend = backend
        self._gauge = gauge
        self._max_age_s = max_age_s
        self._clock = clock
        self._last: Readiness | None = None
        self._probed_at = float("-inf")
        self._probe: asyncio.Task[Readiness] | None = None

    @property
    def last(self) -> Readiness | None:
        """The latest probe's answer (None before the first)."""
        return self._last

    async def probe(self) -> Readiness:
        """A fresh probe; callers at the same time share it."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._run_probe())
        return await asyncio.shield(self._probe)

    async def recent(self) -> Readiness:
        """The latest probe if younger than max_age_s, else a fresh one."""
        if self._last is not None and self._clock() - self._probed_at < self._max_age_s:
            return self._last
        return await self.probe()

    def degraded_now(self) -> list[str]:
        """The dependencies the latest probe found down, without waiting; starts
        the next probe in the background when the latest is old."""
        if self._clock() - self._probed_at >= self._max_age_s and (self._probe is None or self._probe.done()):
            self._probe = asyncio.ensure_future(self._run_probe())
        return list(self._last.degraded) if self._last is not None else []

    async def _run_probe(self) -> Readiness:
        readiness = await self._backend.readiness()
        self._last, self._probed_at = readiness, self._clock()
        for name, up in readiness.dependencies:
            self._gauge.labels(dependency=name).set(1 if up else 0)
        return readiness
