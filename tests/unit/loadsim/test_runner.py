"""Closed- and open-loop runs on a virtual clock with a fake transport."""

from __future__ import annotations

import asyncio
import random

import pytest

from loadsim.runner import RunLimits, run_closed_loop, run_open_loop
from loadsim.transport import RequestRecord
from loadsim.users import PlannedRequest, make_users
from loadsim.workload import parse_workload


class VirtualTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


class FakeTransport:
    """Answers every request after `latency_s` of virtual time."""

    def __init__(self, time: VirtualTime, latency_s: float = 0.0) -> None:
        self.time = time
        self.latency_s = latency_s
        self.sent: list[tuple[float, PlannedRequest]] = []

    async def send(self, request: PlannedRequest, started_s: float) -> RequestRecord:
        self.sent.append((started_s, request))
        await self.time.sleep(self.latency_s)
        return RequestRecord(user=request.user, user_class=request.user_class, template=request.template,
                             started_s=started_s, latency_s=self.latency_s)


WORKLOAD = parse_workload({"templates": [{"name": "t", "prompts": ["p"]}],
                           "users": [{"name": "thinker", "think_time_s": 1.0, "think_jitter": 0.0},
                                     {"name": "eager", "think_time_s": 0.0, "think_jitter": 0.0}]})


def test_limits_need_a_bound() -> None:
    with pytest.raises(ValueError):
        RunLimits()
    with pytest.raises(ValueError):
        RunLimits(duration_s=0)
    with pytest.raises(ValueError):
        RunLimits(max_requests=0)


async def test_closed_loop_stops_at_the_request_count() -> None:
    time = VirtualTime()
    transport = FakeTransport(time, latency_s=0.1)
    users = make_users(WORKLOAD, 4, seed=0, model="m")
    result = await run_closed_loop(users, transport, RunLimits(max_requests=10), clock=time.clock, sleep=time.sleep)
    assert len(result.records) == len(transport.sent) == 10
    assert {r.user for r in result.records} == {u.name for u in users}


async def test_closed_loop_users_think_between_requests() -> None:
    time = VirtualTime()
    transport = FakeTransport(time)
    users = make_users(WORKLOAD, 2, seed=0, model="m")     # one thinker (1 s), one eager (0 s)
    await run_closed_loop(users, transport, RunLimits(duration_s=3.5), clock=time.clock, sleep=time.sleep)
    thinker = [started for started, req in transport.sent if req.user_class == "thinker"]
    assert thinker == [0.0, 1.0, 2.0, 3.0]     # started before the deadline, one think time apart


async def test_open_loop_follows_the_poisson_schedule() -> None:
    time = VirtualTime()
    transport = FakeTransport(time)
    users = make_users(WORKLOAD, 3, seed=5, model="m")
    result = await run_open_loop(users, transport, rate_per_s=4.0, limits=RunLimits(duration_s=10.0), seed=5,
                                 clock=time.clock, sleep=time.sleep)
    gaps = random.Random("5:arrivals")
    expected, at = [], 0.0
    while at < 10.0:
        expected.append(at)
        at += gaps.expovariate(4.0)
    assert [started for started, _ in transport.sent] == pytest.approx(expected)
    assert 25 <= len(result.records) <= 55                   # ~40 at 4/s for 10 s
    assert [req.user for _, req in transport.sent[:4]] == [users[0].name, users[1].name, users[2].name,
                                                          users[0].name]


async def test_open_loop_does_not_wait_for_answers() -> None:
    time = VirtualTime()
    transport = FakeTransport(time, latency_s=100.0)          # slower than the arrivals
    users = make_users(WORKLOAD, 1, seed=0, model="m")
    result = await run_open_loop(users, transport, rate_per_s=10.0, limits=RunLimits(max_requests=20),
                                 clock=time.clock, sleep=time.sleep)
    assert len(result.records) == 20
    with pytest.raises(ValueError):
        await run_open_loop(users, transport, rate_per_s=0, limits=RunLimits(max_requests=1))
