"""How the scheduler's step loop sends one worker its steps: a Step call each
(`unary`), or every step over one StepStream call (`stream`, the default: half the
CPU a step on both sides, which on a small machine is time taken from the
worker's forward).

Either way `send` returns a future of the step's reply, and the loop awaits the
oldest first. A failure of a step is a StepFailed with the gRPC status; on the
stream a failure (the worker's error, its death, a step past its deadline) fails
every step still waiting, since the call carrying them is gone.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import grpc
from fairserve.v1 import worker_pb2, worker_pb2_grpc


STEP_TRANSPORTS = ("stream", "unary")   # STEP_TRANSPORT: one StepStream call, or a Step call each


class StepFailed(Exception):
    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code} {details}")
        self.code = code
        self.details = details

    @classmethod
    def of(cls, error: grpc.aio.AioRpcError) -> StepFailed:
        return cls(error.code().name, error.details() or "")


class UnarySteps:
    """A Step call per step, each with its own deadline."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, timeout_s: float | None) -> None:
        self._stub = stub
        self._timeout_s = timeout_s

    async def send(self, request: worker_pb2.StepRequest) -> asyncio.Future[worker_pb2.StepResponse]:
        return asyncio.ensure_future(self._call(request))

    async def _call(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        try:
            return await self._stub.Step(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            raise StepFailed.of(error) from error

    def close(self) -> None:
        """Nothing to close: each call ends with its step (the loop cancels those left)."""


class StreamSteps:
    """Every step over one StepStream call, opened at the first step. The worker replies
    in request order, so each reply resolves the oldest step still waiting. A step's
    deadline runs from its send: past it, the stream is failed (DEADLINE_EXCEEDED)."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, timeout_s: float | None) -> None:
        self._stub = stub
        self._timeout_s = timeout_s
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: deque[tuple[asyncio.Future[worker_pb2.StepResponse], asyncio.TimerHandle | None]] = deque()
        self._failure: StepFailed | None = None

    async def send(self, request: worker_pb2.StepRequest) -> asyncio.Future[worker_pb2.StepResponse]:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[worker_pb2.StepResponse] = loop.create_future()
        reply.add_done_callback(_retrieved)   # a failure nobody awaits any more is no error
        if self._failure is not None:
            reply.set_exception(self._failure)
            return reply
        if self._call is None:
            self._call = self._stub.StepStream()
            self._reader = asyncio.ensure_future(self._read())
        deadline = loop.call_later(self._timeout_s, self._deadline_passed) if self._timeout_s else None
        self._waiting.append((reply, deadline))
        try:
            await self._call.write(request)
        except grpc.aio.AioRpcError as error:
            self._fail(StepFailed.of(error))
        except asyncio.InvalidStateError:   # the call already ended; the reader reports how
            pass
        except asyncio.CancelledError:
            # A write still waiting when _fail cancelled the call (a worker too stuck to read)
            # fails with the stream; only the caller's own cancellation goes on up.
            task = asyncio.current_task()
            if self._failure is None or (task is not None and task.cancelling()):
                raise
        return reply

    async def _read(self) -> None:
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    self._fail(StepFailed("UNAVAILABLE", "the worker ended the step stream"))
                    return
                if not self._waiting:
                    self._fail(StepFailed("INTERNAL", "a step reply nobody waits for"))
                    return
                reply, deadline = self._waiting.popleft()
                if deadline is not None:
                    deadline.cancel()
                if not reply.done():
                    reply.set_result(response)
        except grpc.aio.AioRpcError as error:
            self._fail(StepFailed.of(error))

    def _deadline_passed(self) -> None:
        self._fail(StepFailed("DEADLINE_EXCEEDED", f"no reply within the step deadline ({self._timeout_s:g} s)"))

    def _fail(self, failure: StepFailed) -> None:
        """Fails every waiting step and every later one; the call is cancelled."""
        if self._failure is None:
            self._failure = failure
        while self._waiting:
            reply, deadline = self._waiting.popleft()
            if deadline is not None:
                deadline.cancel()
            if not reply.done():
                reply.set_exception(self._failure)
        if self._call is not None:
            self._call.cancel()

    def close(self) -> None:
        self._fail(StepFailed("CANCELLED", "the scheduler closed the step stream"))
        if self._reader is not None:
            self._reader.cancel()


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def step_link(transport: str, stub: worker_pb2_grpc.WorkerStub, timeout_s: float | None) -> UnarySteps | StreamSteps:
    if transport == "unary":
        return UnarySteps(stub, timeout_s)
    if transport == "stream":
        return StreamSteps(stub, timeout_s)
    raise ValueError(f"unknown step transport {transport!r}: one of {', '.join(STEP_TRANSPORTS)}")
