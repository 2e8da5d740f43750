"""The gateway's requests over one GenerateMany call to the scheduler
(services/scheduler/stream_mux.py has the scheduler's side and a picture).

One call carries every request of this gateway: a request is a stream number on
it; its submit and, when its caller leaves early, its cancel go out in the next
message (all that queued meanwhile in one); each message in carries events for
many streams, which a reader hands to each request's queue. So the scheduler writes
one message per moment of progress for the whole gateway instead of one per token
per request. A request's consumer reads its own queue at its own pace: a slow one
holds only its own events here, never the call.

When the call ends (the scheduler lost or restarting), every request on it fails
with the error its own Generate call would have ended with (a lost scheduler is
SchedulerLost, which continuation.py survives); the next request opens a new call."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.gateway import convert
from services.gateway.requests.backend import BackendError, SchedulerLost

log = logging.getLogger(__name__)

Item = scheduler_pb2.StreamEvent | BackendError


class Outbox:
    """What goes out on a GenerateMany call: the submits and cancels made meanwhile, together
    in its next message. `send` writes until the call ends."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._submits: list[scheduler_pb2.StreamSubmit] = []
        self._cancels: list[int] = []
        self._wake = asyncio.Event()

    def submit(self, submit: scheduler_pb2.StreamSubmit) -> None:
        self._submits.append(submit)
        self._wake.set()

    def cancel(self, stream: int) -> None:
        self._cancels.append(stream)
        self._wake.set()

    async def send(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            message = scheduler_pb2.StreamRequest(submit=self._submits, cancel=self._cancels)
            self._submits, self._cancels = [], []
            try:
                await self._call.write(message)
            except Exception as error:   # the call ended: the reader says how
                log.debug("scheduler stream write failed", extra={"error": repr(error)})
                return


class _Call:
    """One GenerateMany call and the requests on it."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, on_message: Callable[[], None]) -> None:
        self.call: Any = stub.GenerateMany()
        self.streams: dict[int, asyncio.Queue[Item]] = {}
        self._outbox = Outbox(self.call)
        self._on_message = on_message
        self._sender = asyncio.create_task(self._outbox.send())
        self.reader = asyncio.create_task(self._read())

    @property
    def alive(self) -> bool:
        return not self.reader.done()

    def submit(self, submit: scheduler_pb2.StreamSubmit) -> asyncio.Queue[Item]:
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self.streams[submit.stream] = queue
        self._outbox.submit(submit)
        return queue

    def cancel(self, stream: int) -> None:
        if self.streams.pop(stream, None) is not None and self.alive:
            self._outbox.cancel(stream)

    def forget(self, stream: int) -> None:
        self.streams.pop(stream, None)

    async def _read(self) -> None:
        error: BackendError
        try:
            async for message in self.call:
                self._on_message()
                for event in message.events:
                    queue = self.streams.get(event.stream)
                    if queue is not None:
                        queue.put_nowait(event)
            error = SchedulerLost("the scheduler ended the request stream")
        except grpc.aio.AioRpcError as rpc_error:
            error = convert.backend_error_from_rpc(rpc_error)
        except asyncio.CancelledError:
            error = SchedulerLost("the gateway is closing")
            raise
        finally:
            self._sender.cancel()
            for queue in self.streams.values():
                queue.put_nowait(error)
            self.streams.clear()

    async def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        self._sender.cancel()
        await asyncio.gather(self.reader, self._sender, return_exceptions=True)


class SchedulerStreams:
    """Requests over one GenerateMany call, opened when first needed and again
    after it ends."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, on_message: Callable[[], None]) -> None:
        self._stub = stub
        self._on_message = on_message
        self._call: _Call | None = None
        self._numbers = itertools.count(1)

    async def generate(self, request: scheduler_pb2.GenerateRequest, trace_id: str,
                       traceparent: str) -> AsyncIterator[scheduler_pb2.GenerateEvent]:
        """The request's events, as a Generate call streams them; its refusal or the
        call's loss raised as the BackendError a Generate call's status would give.
        Leaving before the last event cancels the request."""
        if self._call is None or not self._call.alive:
            self._call = _Call(self._stub, self._on_message)
        call = self._call
        stream = next(self._numbers)
        queue = call.submit(scheduler_pb2.StreamSubmit(stream=stream, request=request, trace_id=trace_id,
                                                       traceparent=traceparent))
        ended = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BackendError):
                    ended = True
                    raise item
                if item.HasField("refusal"):
                    ended = True
                    raise convert.backend_error_from_status(
                        _status(item.refusal.code), item.refusal.message,
                        tuple(item.refusal.metadata.items()))
                ended = item.event.HasField("finish")
                yield item.event
                if ended:
                    return
        finally:
            if ended:
                call.forget(stream)
            else:
                call.cancel(stream)

    async def close(self) -> None:
        if self._call is not None:
            await self._call.close()


def _status(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN
