"""Steps over one stream (step_stream.py): each request starts as it arrives, the
replies go back in request order, and a failure ends the stream and what had
not finished."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.worker.step_stream import replies_in_order


class Requests:
    """A request stream the test feeds by hand."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[int | None] = asyncio.Queue()

    def send(self, value: int | None) -> None:
        self._queue.put_nowait(value)

    def __aiter__(self) -> AsyncIterator[int]:
        return self

    async def __anext__(self) -> int:
        value = await self._queue.get()
        if value is None:
            raise StopAsyncIteration
        return value


async def test_replies_come_in_request_order_and_each_step_starts_as_it_arrives() -> None:
    requests, started = Requests(), []
    release = {n: asyncio.Event() for n in (1, 2, 3)}

    async def step(n: int) -> str:
        started.append(n)
        await release[n].wait()
        return f"reply {n}"

    replies: list[str] = []

    async def collect() -> None:
        async for reply in replies_in_order(requests, step):
            replies.append(reply)

    collector = asyncio.create_task(collect())
    for n in (1, 2, 3):
        requests.send(n)
    await asyncio.sleep(0.01)
    assert started == [1, 2, 3] and replies == []     # all three running, none answered
    release[3].set()
    release[2].set()
    await asyncio.sleep(0.01)
    assert replies == []                               # 2 and 3 wait behind 1
    release[1].set()
    requests.send(None)
    await asyncio.wait_for(collector, 1.0)
    assert replies == ["reply 1", "reply 2", "reply 3"]


async def test_a_failed_step_ends_the_stream_and_cancels_the_steps_behind_it() -> None:
    requests, cancelled = Requests(), []

    async def step(n: int) -> int:
        if n == 1:
            await asyncio.sleep(0.01)
            raise ValueError("malformed batch")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(n)
            raise
        return n

    requests.send(1)
    requests.send(2)
    with pytest.raises(ValueError, match="malformed"):
        async for _ in replies_in_order(requests, step):
            pass
    await asyncio.sleep(0)
    assert cancelled == [2]


async def test_the_stream_ending_ends_the_replies_after_the_last() -> None:
    requests = Requests()
    for n in (4, 5):
        requests.send(n)
    requests.send(None)

    async def step(n: int) -> int:
        return n * 10

    assert [reply async for reply in replies_in_order(requests, step)] == [40, 50]
