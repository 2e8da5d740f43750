"""Driving one running system through the sweep: closed-loop points at fixed
concurrency, open-loop points at Poisson request rates, and the chat-like
multi-turn point. Every request is a streamed /v1/completions call, greedy,
with exactly `max_tokens` tokens asked for (see systems.greedy_fields).

A point stops starting requests after `point_cap_s`, and cuts the requests
still running `drain_s` later (recorded as failed, "cut at the point's time
limit"): a system far slower than the others still finishes in time, and the
report counts what was sent and what came back.

While each point runs, a `ResidentSampler` reads the resident memory of every
service of the system (resident.py): the point keeps its peak and closing figures.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

from benchmarks.head_to_head.resident import Resident, ResidentSampler
from benchmarks.head_to_head.systems import Served, greedy_fields
from benchmarks.head_to_head.workload import ChatMix, CompletionRequest, chat_prompt, unique_requests
from loadsim.transport import OK, TRANSPORT_ERROR, HttpTransport, RequestRecord
from loadsim.users import PlannedRequest


@dataclass(frozen=True)
class Plan:
    concurrencies: tuple[int, ...] = (1, 8, 32)
    rates: tuple[float, ...] = (0.5, 1.0, 2.0)     # () for no Poisson points
    max_tokens: int = 64
    requests_per_slot: float = 1.5      # a closed-loop point sends max(min_requests, slots x this)
    min_requests: int = 4
    rate_requests: int = 10             # requests per Poisson point
    chat_users: int = 8
    chat_conversations: int = 10
    chat_max_turns: int = 3
    chat_max_tokens: int = 32
    point_cap_s: float = 60.0
    drain_s: float = 60.0               # then requests still running after this much more are cut
    short_prompts: bool = False         # the tiny model
    seed: int = 0
    memory_interval_s: float = 0.25     # between resident-memory readings while a point runs

    def closed_count(self, concurrency: int) -> int:
        return max(self.min_requests, round(concurrency * self.requests_per_slot))


@dataclass
class PointRun:
    kind: str                           # "concurrency", "rate" or "chat"
    x: float                            # the concurrency, the rate, or the chat users
    records: list[RequestRecord] = field(default_factory=list)
    expected_tokens: list[int] = field(default_factory=list)   # per record, what it asked for
    duration_s: float = 0.0
    resident: Resident | None = None    # the system's services' resident memory during the point


class Driver:
    def __init__(self, system: str, served: Served, plan: Plan) -> None:
        self.system, self.served, self.plan = system, served, plan
        self._transport = HttpTransport(served.url, timeout_s=600.0)

    async def close(self) -> None:
        await self._transport.close()

    def _planned(self, prompt: str, max_tokens: int, name: str) -> PlannedRequest:
        body = {"model": self.served.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True},
                **greedy_fields(self.system, max_tokens)}
        return PlannedRequest(user=name, user_class=self.system, template=name, path="/v1/completions", body=body)

    async def _send(self, run: PointRun, prompt: str, max_tokens: int, started: float) -> RequestRecord:
        planned, at = self._planned(prompt, max_tokens, run.kind), time.monotonic() - started
        limit = self.plan.point_cap_s + self.plan.drain_s - at
        try:
            record = await asyncio.wait_for(self._transport.send(planned, at), timeout=max(limit, 0.001))
        except asyncio.TimeoutError:
            record = RequestRecord(user=planned.user, user_class=planned.user_class, template=planned.template,
                                   started_s=at, outcome=TRANSPORT_ERROR, latency_s=limit,
                                   error="cut at the point's time limit")
        run.records.append(record)
        run.expected_tokens.append(max_tokens)
        return record

    async def closed(self, concurrency: int, requests: list[CompletionRequest]) -> PointRun:
        run, queue, started = PointRun("concurrency", concurrency), list(reversed(requests)), time.monotonic()

        async def slot() -> None:
            while queue and time.monotonic() - started < self.plan.point_cap_s:
                request = queue.pop()
                await self._send(run, request.prompt, request.max_tokens, started)

        await asyncio.gather(*(slot() for _ in range(concurrency)))
        run.duration_s = time.monotonic() - started
        return run

    async def poisson(self, rate: float, requests: list[CompletionRequest]) -> PointRun:
        run, arrivals, started = PointRun("rate", rate), random.Random(f"arrivals:{self.plan.seed}:{rate}"), \
            time.monotonic()
        tasks, at = [], 0.0
        for request in requests:
            if at > self.plan.point_cap_s:
                break
            await asyncio.sleep(max(0.0, at - (time.monotonic() - started)))
            tasks.append(asyncio.create_task(self._send(run, request.prompt, request.max_tokens, started)))
            at += arrivals.expovariate(rate)
        await asyncio.gather(*tasks)
        run.duration_s = time.monotonic() - started
        return run

    async def chat(self, users: int, conversations: int) -> PointRun:
        """`users` users, each going through conversations (drawn in order from
        one seeded mix) until `conversations` have started."""
        plan = self.plan
        run, mix, started = PointRun("chat", users), ChatMix(plan.seed, plan.chat_max_turns, plan.short_prompts), \
            time.monotonic()
        drawn = [mix.conversation() for _ in range(conversations)]
        drawn.reverse()

        async def user() -> None:
            while drawn and time.monotonic() - started < plan.point_cap_s:
                conversation, history = drawn.pop(), []
                for question in conversation.questions:
                    prompt = chat_prompt(conversation.system, history, question)
                    record = await self._send(run, prompt, plan.chat_max_tokens, started)
                    if record.outcome != OK:
                        break
                    history.append((question, record.text))

        await asyncio.gather(*(user() for _ in range(users)))
        run.duration_s = time.monotonic() - started
        return run


async def warm_up(driver: Driver) -> None:
    """Two short requests, so no point pays for first-call costs."""
    requests = unique_requests(2, 8, seed=-1, short=driver.plan.short_prompts)
    await driver.closed(2, requests)


async def sampled(served: Served, plan: Plan, run: Awaitable[PointRun]) -> PointRun:
    """`run`, with its services' resident memory read throughout (see resident.py)."""
    sampler = ResidentSampler(served.services, plan.memory_interval_s).start()
    try:
        result = await run
    finally:
        resident = sampler.finish()
    result.resident = resident
    return result


async def sweep(system: str, served: Served, plan: Plan, chat: bool = True) -> list[PointRun]:
    driver = Driver(system, served, plan)
    try:
        await warm_up(driver)
        points = []
        for concurrency in plan.concurrencies:
            requests = unique_requests(plan.closed_count(concurrency), plan.max_tokens,
                                       seed=plan.seed * 1000 + concurrency, short=plan.short_prompts)
            points.append(await sampled(served, plan, driver.closed(concurrency, requests)))
        for index, rate in enumerate(plan.rates):
            requests = unique_requests(plan.rate_requests, plan.max_tokens, seed=plan.seed * 1000 + 500 + index,
                                       short=plan.short_prompts)
            points.append(await sampled(served, plan, driver.poisson(rate, requests)))
        if chat:
            points.append(await sampled(served, plan, driver.chat(plan.chat_users, plan.chat_conversations)))
        return points
    finally:
        await driver.close()
