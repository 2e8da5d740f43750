"""A load driver's requests over one GenerateMany call, as cheap as the protocol allows: the
scale benchmark's default client (scale_bench.py).

The scheduler sees what a gateway sends it (services/gateway/streaming/scheduler_streams.py):
submits gathered into the next message, events for many streams in each message read back.
What differs is on this side only: the gateway hands each event to a per-request queue that its
HTTP consumer reads at its own pace, a queue put and a wake-up per event; a load driver has no
consumer to pace, so each event goes to its request's handler as it is read and the request's
coroutine wakes once, when it ends. On the two cores the whole benchmark shares, that queue's CPU
(a third of the driver's) was taken from the scheduler it measures; a gateway runs on its own.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import grpc
from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.gateway.streaming.scheduler_streams import Outbox

EventHandler = Callable[[scheduler_pb2.GenerateEvent], None]


class StreamRefused(Exception):
    """The scheduler refused a request (the status its Generate call would have ended with)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")


class LeanStreams:
    """Requests over one GenerateMany call, opened at construction (on the running loop)."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self._call: Any = stub.GenerateMany()
        self._open: dict[int, tuple[EventHandler, asyncio.Future[None]]] = {}
        self._outbox = Outbox(self._call)
        self._numbers = itertools.count(1)
        self._sender = asyncio.create_task(self._outbox.send())
        self._reader = asyncio.create_task(self._read())

    async def generate(self, request: scheduler_pb2.GenerateRequest, on_event: EventHandler) -> None:
        """Sends `request` and returns when its last event went to `on_event`. A refusal raises
        StreamRefused, the call's end the error it ended with; leaving early cancels the request."""
        if self._reader.done():
            raise StreamRefused("UNAVAILABLE", "the GenerateMany call ended")
        stream = next(self._numbers)
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._open[stream] = (on_event, ended)
        self._outbox.submit(scheduler_pb2.StreamSubmit(stream=stream, request=request, trace_id=request.request_id))
        try:
            await ended
        finally:
            if self._open.pop(stream, None) is not None:
                self._outbox.cancel(stream)

    async def _read(self) -> None:
        error: Exception = StreamRefused("UNAVAILABLE", "the scheduler ended the GenerateMany call")
        try:
            async for message in self._call:
                for item in message.events:
                    self._take(item)
        except grpc.aio.AioRpcError as rpc_error:
            error = StreamRefused(rpc_error.code().name, rpc_error.details() or "")
        finally:
            self._sender.cancel()
            for _, ended in self._open.values():
                if not ended.done():
                    ended.set_exception(error)
            self._open.clear()

    def _take(self, item: scheduler_pb2.StreamEvent) -> None:
        handler = self._open.get(item.stream)
        if handler is None:
            return      # cancelled meanwhile
        on_event, ended = handler
        if item.HasField("refusal"):
            del self._open[item.stream]
            ended.set_exception(StreamRefused(grpc.StatusCode(_status(item.refusal.code)).name,
                                              item.refusal.message))
            return
        on_event(item.event)
        if item.event.HasField("finish"):
            del self._open[item.stream]
            ended.set_result(None)

    async def close(self) -> None:
        self._call.cancel()
        self._sender.cancel()
        self._reader.cancel()
        await asyncio.gather(self._sender, self._reader, return_exceptions=True)


def _status(code: int) -> tuple[int, str]:
    """grpc.StatusCode's value for a numeric status code (UNKNOWN for one it does not have)."""
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.value
    return grpc.StatusCode.UNKNOWN.value
