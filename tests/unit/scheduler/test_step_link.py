"""The scheduler's side of the step stream (step_link.py) over a scripted call:
replies resolve the steps in the order sent, and any end of the call (the worker's
error, its end, a step past its deadline, even with a write stuck) fails every
step still waiting and every later one."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fairserve.v1 import worker_pb2

from services.scheduler.workers.step_link import StepFailed, StreamSteps, UnarySteps, step_link


class ScriptedCall:
    """A StepStream call whose replies the test hands over; `stuck` writes never complete."""

    def __init__(self, stuck: bool = False) -> None:
        self.written: list[int] = []
        self.cancelled = False
        self._replies: asyncio.Queue[object] = asyncio.Queue()
        self._stuck = stuck
        self._cancel = asyncio.Event()

    async def write(self, request: worker_pb2.StepRequest) -> None:
        if self._stuck:
            await self._cancel.wait()
            raise asyncio.CancelledError()     # what grpc raises once the call is cancelled locally
        self.written.append(request.step_id)

    async def read(self) -> object:
        reply = asyncio.ensure_future(self._replies.get())
        cancel = asyncio.ensure_future(self._cancel.wait())
        await asyncio.wait({reply, cancel}, return_when=asyncio.FIRST_COMPLETED)
        cancel.cancel()
        if not reply.done():
            reply.cancel()
            raise asyncio.CancelledError()
        value = reply.result()
        if isinstance(value, BaseException):
            raise value
        return value

    def reply(self, value: object) -> None:
        self._replies.put_nowait(value)

    def cancel(self) -> bool:
        self.cancelled = True
        self._cancel.set()
        return True


class Stub:
    def __init__(self, call: ScriptedCall) -> None:
        self.call = call
        self.opened = 0

    def StepStream(self) -> ScriptedCall:
        self.opened += 1
        return self.call


async def test_replies_resolve_the_steps_in_the_order_sent() -> None:
    stub = Stub(ScriptedCall())
    steps = StreamSteps(stub, timeout_s=5.0)
    first = await steps.send(worker_pb2.StepRequest(step_id=1))
    second = await steps.send(worker_pb2.StepRequest(step_id=2, after_step_id=1))
    assert stub.opened == 1 and stub.call.written == [1, 2]
    stub.call.reply(worker_pb2.StepResponse(step_id=1))
    assert (await asyncio.wait_for(first, 1.0)).step_id == 1 and not second.done()
    stub.call.reply(worker_pb2.StepResponse(step_id=2))
    assert (await asyncio.wait_for(second, 1.0)).step_id == 2
    steps.close()
    assert stub.call.cancelled


@pytest.mark.parametrize("ending, code", [
    (grpc.aio.EOF, "UNAVAILABLE"),
    (grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                          "stale epoch"), "INVALID_ARGUMENT"),
])
async def test_the_call_ending_fails_every_waiting_step_and_every_later_one(ending: object, code: str) -> None:
    stub = Stub(ScriptedCall())
    steps = StreamSteps(stub, timeout_s=5.0)
    waiting = [await steps.send(worker_pb2.StepRequest(step_id=n)) for n in (1, 2)]
    stub.call.reply(ending)
    for reply in waiting:
        with pytest.raises(StepFailed) as failed:
            await asyncio.wait_for(reply, 1.0)
        assert failed.value.code == code
    later = await steps.send(worker_pb2.StepRequest(step_id=3))
    with pytest.raises(StepFailed):
        await later
    assert stub.opened == 1 and stub.call.cancelled


async def test_a_step_past_its_deadline_fails_the_stream_even_with_its_write_stuck() -> None:
    stub = Stub(ScriptedCall(stuck=True))
    steps = StreamSteps(stub, timeout_s=0.05)
    reply = await asyncio.wait_for(steps.send(worker_pb2.StepRequest(step_id=1)), 1.0)
    with pytest.raises(StepFailed, match="deadline") as failed:
        await reply
    assert failed.value.code == "DEADLINE_EXCEEDED" and stub.call.cancelled


async def test_the_callers_own_cancellation_still_cancels_a_stuck_send() -> None:
    steps = StreamSteps(Stub(ScriptedCall(stuck=True)), timeout_s=None)
    send = asyncio.ensure_future(steps.send(worker_pb2.StepRequest(step_id=1)))
    await asyncio.sleep(0.01)
    send.cancel()
    with pytest.raises(asyncio.CancelledError):
        await send


def test_the_transport_is_chosen_by_name() -> None:
    assert isinstance(step_link("stream", Stub(ScriptedCall()), None), StreamSteps)
    assert isinstance(step_link("unary", Stub(ScriptedCall()), None), UnarySteps)
    with pytest.raises(ValueError, match="udp"):
        step_link("udp", Stub(ScriptedCall()), None)
