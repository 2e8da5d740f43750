"""DrainWorker through the real gRPC scheduler with fake workers, driven by
the worker's own drain loop (services/worker/drain.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fairserve.v1 import scheduler_pb2

from services.worker.drain import DrainEnd, drain

from tests.unit.scheduler.fake_worker import reference_output
from tests.unit.scheduler.test_transport import (  # noqa: F401  (make_stack: the fixture)
    PROMPT, _eventually, _request, _wait_for_stats, make_stack)


async def test_a_draining_workers_stream_moves_to_another_worker_and_it_is_dropped(make_stack) -> None:
    stack = await make_stack()
    leaving = await stack.add_worker("w0", step_delay_s=0.01)
    stream = aiter(stack.stub.Generate(_request("long", max_tokens=60), timeout=20))
    first = [await anext(stream) for _ in range(5)]
    staying = await stack.add_worker("w1", step_delay_s=0.01)
    leaving.stop_heartbeats()
    end = await drain(stack.stub, "w0", 5.0, asyncio.Event(), poll_s=0.01)
    assert end is DrainEnd.DRAINED
    events = first + [e async for e in stream]
    assert [t.token_id for e in events for t in e.tokens] == reference_output(PROMPT, 60)
    assert events[-1].finish.finish_reason == "length"
    stats = await stack.stats()
    assert [w.worker_id for w in stats.workers] == ["w1"] and stats.migrations == 1
    assert staying.engine.steps
    await _eventually(lambda: not staying.engine.seqs)


async def test_a_lone_draining_worker_serves_its_stream_to_the_end_and_refuses_new_ones(make_stack) -> None:
    stack = await make_stack()
    await stack.add_worker("w0", step_delay_s=0.01)
    call = stack.stub.Generate(_request("long", max_tokens=40), timeout=20)
    stream = aiter(call)
    first = await anext(stream)
    draining = asyncio.create_task(drain(stack.stub, "w0", 10.0, asyncio.Event(), poll_s=0.01))
    await _wait_for_stats(stack, lambda stats: not stats.workers[0].healthy)   # draining
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await anext(aiter(stack.stub.Generate(_request("new"), timeout=5)))
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert not draining.done()
    events = [first] + [e async for e in stream]
    assert [t.token_id for e in events for t in e.tokens] == reference_output(PROMPT, 40)
    assert await asyncio.wait_for(draining, 5) is DrainEnd.DRAINED
    assert not (await stack.stats()).workers


async def test_draining_times_out_and_an_unknown_worker_has_nothing_to_hand_over(make_stack) -> None:
    stack = await make_stack()
    await stack.add_worker("w0", step_delay_s=0.01)
    call = stack.stub.Generate(_request("long", max_tokens=1000), timeout=20)
    await anext(aiter(call))
    assert await drain(stack.stub, "w0", 0.1, asyncio.Event(), poll_s=0.01) is DrainEnd.TIMEOUT
    reply = await stack.stub.DrainWorker(scheduler_pb2.DrainWorkerRequest(worker_id="nobody"), timeout=5)
    assert not reply.known and reply.remaining == 0
    call.cancel()
