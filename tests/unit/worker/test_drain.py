"""The worker's drain loop against a scripted scheduler: it asks until nothing
is left, and stops asking at its deadline, on a second signal, or when the
scheduler does not know it or cannot be reached."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
from fairserve.v1 import scheduler_pb2

from services.worker.drain import DrainEnd, drain


class ScriptedScheduler:
    """Answers DrainWorker with `replies` in turn (the last one again and again)."""

    def __init__(self, replies: Sequence[scheduler_pb2.DrainWorkerResponse | grpc.aio.AioRpcError]) -> None:
        self.replies = list(replies)
        self.calls: list[str] = []

    async def DrainWorker(self, request: scheduler_pb2.DrainWorkerRequest,
                          timeout: float) -> scheduler_pb2.DrainWorkerResponse:
        self.calls.append(request.worker_id)
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        if isinstance(reply, grpc.aio.AioRpcError):
            raise reply
        return reply


def _reply(remaining: int, known: bool = True) -> scheduler_pb2.DrainWorkerResponse:
    return scheduler_pb2.DrainWorkerResponse(known=known, remaining=remaining)


async def test_asks_again_until_nothing_is_left() -> None:
    scheduler = ScriptedScheduler([_reply(2), _reply(1), _reply(0)])
    end = await drain(scheduler, "w0", 5.0, asyncio.Event(), poll_s=0.001)  # type: ignore[arg-type]
    assert end is DrainEnd.DRAINED and scheduler.calls == ["w0"] * 3


async def test_stops_at_its_deadline_with_requests_left() -> None:
    scheduler = ScriptedScheduler([_reply(1)])
    end = await drain(scheduler, "w0", 0.05, asyncio.Event(), poll_s=0.01)  # type: ignore[arg-type]
    assert end is DrainEnd.TIMEOUT and 2 <= len(scheduler.calls) <= 10


async def test_a_second_signal_stops_it_at_once() -> None:
    interrupted = asyncio.Event()
    scheduler = ScriptedScheduler([_reply(1)])
    task = asyncio.create_task(drain(scheduler, "w0", 30.0, interrupted, poll_s=10))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    interrupted.set()
    assert await asyncio.wait_for(task, 1) is DrainEnd.INTERRUPTED


async def test_an_unknown_worker_or_an_unreachable_scheduler_ends_it() -> None:
    unknown = ScriptedScheduler([_reply(0, known=False)])
    assert await drain(unknown, "w0", 5.0, asyncio.Event()) is DrainEnd.UNKNOWN  # type: ignore[arg-type]
    error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                 "connection refused")
    unreachable = ScriptedScheduler([error])
    assert await drain(unreachable, "w0", 5.0, asyncio.Event()) is DrainEnd.UNREACHABLE  # type: ignore[arg-type]
