"""GenerateMany, the real scheduler against fake worker servers: many requests over
one call give the tokens Generate gives, batched into few messages; refusals, cancels
and the call's end act per stream as they do per Generate call; and through the
gateway's client, a request whose reader stalls holds up no other."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import grpc
import pytest
from fairserve.v1 import scheduler_pb2

from common.transport.grpc_server import REJECTION_KEY
from common.types import SamplingParams
from services.gateway.requests.backend import GenerationSpec, InvalidGeneration, SchedulerLost
from services.gateway.streaming.scheduler_client import SchedulerClient

from tests.unit.scheduler.fake_worker import reference_output
from tests.unit.scheduler.test_transport import PROMPT, _eventually, _request, make_stack  # noqa: F401


class Call:
    """A GenerateMany call driven by hand: submits and cancels in, events by stream out."""

    def __init__(self, stack) -> None:
        self._outgoing: asyncio.Queue[scheduler_pb2.StreamRequest | None] = asyncio.Queue()
        self.call = stack.stub.GenerateMany(self._requests(), timeout=20)
        self.events: dict[int, list[scheduler_pb2.StreamEvent]] = {}
        self.messages = 0
        self._reader = asyncio.create_task(self._read())

    async def _requests(self):
        while (message := await self._outgoing.get()) is not None:
            yield message

    async def _read(self) -> None:
        async for message in self.call:
            self.messages += 1
            for event in message.events:
                self.events.setdefault(event.stream, []).append(event)

    def send(self, *submits: tuple[int, scheduler_pb2.GenerateRequest], cancel: tuple[int, ...] = ()) -> None:
        self._outgoing.put_nowait(scheduler_pb2.StreamRequest(
            submit=[scheduler_pb2.StreamSubmit(stream=stream, request=request) for stream, request in submits],
            cancel=cancel))

    def ended(self, stream: int) -> bool:
        events = self.events.get(stream, [])
        return bool(events) and (events[-1].HasField("refusal") or events[-1].event.HasField("finish"))

    def tokens(self, stream: int) -> list[int]:
        return [token.token_id for event in self.events.get(stream, []) for token in event.event.tokens]

    def packed(self, stream: int) -> list[int]:
        return [token_id for event in self.events.get(stream, []) for token_id in event.event.token_ids]

    async def close(self) -> None:
        self._outgoing.put_nowait(None)
        await asyncio.wait_for(self._reader, 10)


async def test_many_requests_over_one_call_get_their_tokens_in_few_messages(make_stack) -> None:
    stack = await make_stack()
    await stack.add_worker(step_delay_s=0.005)
    call = Call(stack)
    call.send(*((stream, _request(f"r{stream}", max_tokens=6)) for stream in range(1, 9)))
    await _eventually(lambda: all(call.ended(stream) for stream in range(1, 9)), timeout_s=10)
    for stream in range(1, 9):
        assert call.tokens(stream) == reference_output(PROMPT, 6)
        finish = call.events[stream][-1].event.finish
        assert finish.finish_reason == "length" and finish.usage.completion_tokens == 6
    # 8 requests x (6 tokens, one finishing): a message per step carries every request's token.
    assert call.messages <= 8 * 6 // 2
    await call.close()              # every request ended: the call ends when the caller stops
    stats = await stack.stats()
    assert stats.finished == 8 and stats.active == 0


async def test_refusals_are_per_stream_and_the_call_goes_on(make_stack) -> None:
    stack = await make_stack()
    call = Call(stack)
    call.send((1, _request("early")))                    # no worker yet
    await _eventually(lambda: call.ended(1))
    refusal = call.events[1][-1].refusal
    assert refusal.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert refusal.metadata[REJECTION_KEY] == "no_worker"   # the scheduler's own, not a lost connection
    await stack.add_worker(step_delay_s=0.01)
    call.send((2, _request("huge", max_tokens=5000)), (3, _request("long", max_tokens=1000)))
    await _eventually(lambda: call.ended(2) and bool(call.tokens(3)))
    assert call.events[2][-1].refusal.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "4096" in call.events[2][-1].refusal.message
    call.send(cancel=(3,))
    await _eventually(lambda: not stack.workers[0].engine.seqs)
    await call.close()


async def test_a_stream_number_used_twice_ends_the_call(make_stack) -> None:
    """A broken caller, not a request: the call ends INVALID_ARGUMENT and its requests are cancelled."""
    stack = await make_stack()
    worker = await stack.add_worker(step_delay_s=0.01)
    call = Call(stack)
    call.send((3, _request("long", max_tokens=1000)))
    await _eventually(lambda: bool(call.tokens(3)))
    call.send((3, _request("again")))
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await asyncio.wait_for(call._reader, 10)
    assert ended.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "in use" in ended.value.details()
    await _eventually(lambda: not worker.engine.seqs)


async def test_a_cancelled_stream_frees_its_sequence_and_the_others_run_on(make_stack) -> None:
    stack = await make_stack()
    worker = await stack.add_worker(step_delay_s=0.01)
    call = Call(stack)
    call.send((1, _request("gone", max_tokens=1000)), (2, _request("stays", max_tokens=30)))
    await _eventually(lambda: bool(call.tokens(1)) and bool(call.tokens(2)))
    call.send(cancel=(1,))
    await _eventually(lambda: call.ended(2), timeout_s=10)
    assert call.tokens(2) == reference_output(PROMPT, 30)
    assert not call.ended(1)           # a cancelled stream gets nothing more
    await _eventually(lambda: not worker.engine.seqs)
    assert worker.engine.pool().used_blocks == 0
    await call.close()


async def test_a_cancel_that_overtakes_its_admission_still_cancels(make_stack) -> None:
    stack = await make_stack()
    worker = await stack.add_worker(step_delay_s=0.01)
    await stack.add_worker("w1", step_delay_s=0.01)   # two workers: admission awaits the index
    call = Call(stack)
    call.send((1, _request("brief", max_tokens=1000)), cancel=(1,))
    await asyncio.sleep(0.3)
    await _eventually(lambda: not worker.engine.seqs and not stack.workers[1].engine.seqs)
    stats = await stack.stats()
    assert stats.active == 0
    await call.close()


async def test_the_call_ending_cancels_its_open_requests(make_stack) -> None:
    stack = await make_stack()
    worker = await stack.add_worker(step_delay_s=0.01)
    call = Call(stack)
    call.send(*((stream, _request(f"r{stream}", max_tokens=1000)) for stream in (1, 2, 3)))
    await _eventually(lambda: all(call.tokens(stream) for stream in (1, 2, 3)))
    call.call.cancel()                 # the gateway went away
    await _eventually(lambda: not worker.engine.seqs)
    stats = await stack.stats()
    assert stats.active == 0


def _spec(**fields: object) -> GenerationSpec:
    values: dict[str, object] = dict(prompt_token_ids=PROMPT, max_tokens=5, sampling=SamplingParams(),
                                     client_id="alice")
    values.update(fields)
    return GenerationSpec(**values)   # type: ignore[arg-type]


async def test_through_the_gateway_client_a_stalled_reader_holds_up_no_other(make_stack) -> None:
    """The attack: one tenant opens a long stream and stops reading it. Its events wait in
    its own queue; another tenant's request on the same call runs to its end."""
    stack = await make_stack()
    await stack.add_worker(step_delay_s=0.002)
    client = SchedulerClient(stack.address, stack.address)
    async with aclosing(client.generate(_spec(max_tokens=400, client_id="mallory"), "stall")) as stalled:
        await anext(stalled)           # then never read again
        events = [event async for event in client.generate(_spec(max_tokens=40, client_id="bob"), "bob")]
        assert [token.token_id for event in events for token in event.tokens] == reference_output(PROMPT, 40)
        assert events[-1].finish.reason == "length"
    with pytest.raises(InvalidGeneration, match="4096"):
        [event async for event in client.generate(_spec(max_tokens=5000), "huge")]
    await _eventually(lambda: not stack.workers[0].engine.seqs)   # closing the stalled one cancelled it
    assert client.scheduler_seen
    await client.close()


async def test_through_the_gateway_client_a_lost_scheduler_fails_every_request_on_the_call(make_stack) -> None:
    stack = await make_stack()
    await stack.add_worker(step_delay_s=0.01)
    client = SchedulerClient(stack.address, stack.address)
    streams = [client.generate(_spec(max_tokens=1000), f"r{index}") for index in range(3)]
    for stream in streams:
        await anext(stream)
    await stack.server.stop(0)
    for stream in streams:
        with pytest.raises(SchedulerLost):   # the continuation's cue
            async for _event in stream:
                pass
    await client.close()


async def test_each_stream_gets_its_tokens_packed_as_its_request_asked(make_stack) -> None:
    stack = await make_stack()
    await stack.add_worker(step_delay_s=0.005)
    call = Call(stack)
    packed, plain = _request("r1", max_tokens=6), _request("r2", max_tokens=6)
    packed.packed_tokens = True
    call.send((1, packed), (2, plain))
    await _eventually(lambda: call.ended(1) and call.ended(2), timeout_s=10)
    assert call.packed(1) == reference_output(PROMPT, 6) and call.tokens(1) == []
    assert call.tokens(2) == reference_output(PROMPT, 6) and call.packed(2) == []
    await call.close()
