"""Runs simulated traffic against a transport.

Closed loop: every user sends a request, waits for the whole answer, thinks,
and sends the next; load follows the server's speed, like real interactive
users. Open loop: requests arrive at a fixed Poisson rate whatever the server
does, which is how throughput-vs-latency curves are measured (a rate the
server cannot sustain shows up as growing latencies and rejections).

Either run stops starting requests at its deadline or request count and then
waits for every request in flight, so nothing sent goes unrecorded.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from loadsim.transport import RequestRecord, Transport
from loadsim.users import SimulatedUser

Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class RunLimits:
    duration_s: float | None = None     # stop starting requests after this long
    max_requests: int | None = None     # stop after starting this many

    def __post_init__(self) -> None:
        if self.duration_s is None and self.max_requests is None:
            raise ValueError("a run needs a duration or a request count")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration must be positive")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("request count must be at least 1")


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float                   # first request sent until the last one finished


class _Budget:
    """Shared stop condition: claims request slots until the limits are reached."""

    def __init__(self, limits: RunLimits, clock: Callable[[], float]) -> None:
        self._limits = limits
        self._clock = clock
        self._start = clock()
        self.started = 0

    def elapsed(self) -> float:
        return self._clock() - self._start

    def remaining_s(self) -> float:
        return float("inf") if self._limits.duration_s is None else self._limits.duration_s - self.elapsed()

    def exhausted(self, at_s: float | None = None) -> bool:
        """No request may start (now, or at `at_s` into the run)."""
        if self._limits.max_requests is not None and self.started >= self._limits.max_requests:
            return True
        at = self.elapsed() if at_s is None else at_s
        return self._limits.duration_s is not None and at >= self._limits.duration_s

    def claim(self) -> bool:
        if self.exhausted():
            return False
        self.started += 1
        return True


async def run_closed_loop(users: Sequence[SimulatedUser], transport: Transport, limits: RunLimits,
                          clock: Callable[[], float] = time.monotonic, sleep: Sleep = asyncio.sleep) -> RunResult:
    budget = _Budget(limits, clock)
    records: list[RequestRecord] = []

    async def user_loop(user: SimulatedUser) -> None:
        while budget.claim():
            request = user.next_request()
            records.append(await transport.send(request, budget.elapsed()))
            pause = min(user.think_time(), budget.remaining_s())
            if pause > 0 and not budget.exhausted():
                await sleep(pause)

    await asyncio.gather(*(user_loop(user) for user in users))
    return RunResult(records, budget.elapsed())


async def run_open_loop(users: Sequence[SimulatedUser], transport: Transport, rate_per_s: float,
                        limits: RunLimits, seed: int = 0, clock: Callable[[], float] = time.monotonic,
                        sleep: Sleep = asyncio.sleep) -> RunResult:
    """Poisson arrivals at `rate_per_s`; arrival i is user i mod len(users)."""
    if rate_per_s <= 0:
        raise ValueError("rate must be positive")
    if not users:
        raise ValueError("an open-loop run needs at least one user")
    budget = _Budget(limits, clock)
    arrivals = random.Random(f"{seed}:arrivals")
    records: list[RequestRecord] = []
    in_flight: list[asyncio.Task[None]] = []

    async def one(user: SimulatedUser, started_s: float) -> None:
        records.append(await transport.send(user.next_request(), started_s))

    next_arrival = 0.0
    index = 0
    while not budget.exhausted(at_s=max(next_arrival, budget.elapsed())):
        wait = next_arrival - budget.elapsed()
        if wait > 0:
            await sleep(wait)
        if not budget.claim():
            break
        in_flight.append(asyncio.create_task(one(users[index % len(users)], budget.elapsed())))
        index += 1
        next_arrival += arrivals.expovariate(rate_per_s)
    await asyncio.gather(*in_flight)
    return RunResult(records, budget.elapsed())
