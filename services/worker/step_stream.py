"""Steps over one stream: a reply per request, in the order of the requests.

The scheduler keeps one StepStream call open per worker and writes each planned
step to it. Requests are read as they come, so with async scheduling step N+1 is
already waiting its turn (step_order.py) while step N runs, as two concurrent
Step calls would be; the replies go back in request order. A step that fails
ends the stream with its error, as it would end its own call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

Request = TypeVar("Request")
Reply = TypeVar("Reply")


async def replies_in_order(requests: AsyncIterator[Request],
                           step: Callable[[Request], Awaitable[Reply]]) -> AsyncIterator[Reply]:
    """`step(request)` for each request as it arrives (concurrently: each waits for its
    own turn), yielding each result in request order. The first failure propagates and
    cancels every step not yet started; the stream's end ends this after the last reply."""
    started: asyncio.Queue[asyncio.Future[Reply] | None] = asyncio.Queue()

    async def read() -> None:
        try:
            async for request in requests:
                started.put_nowait(asyncio.ensure_future(step(request)))
        finally:
            started.put_nowait(None)

    reader = asyncio.ensure_future(read())
    try:
        while (running := await started.get()) is not None:
            yield await running
        await reader   # a read error surfaces here
    finally:
        reader.cancel()
        while not started.empty():
            left = started.get_nowait()
            if left is not None:
                left.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
