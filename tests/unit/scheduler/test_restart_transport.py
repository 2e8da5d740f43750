"""What the scheduler does, over gRPC, so that a restart of it loses nothing: each
registration of a worker begins a larger epoch, which its steps carry; its
refusals are marked as its own (a gateway tells them from a lost connection);
and a continuation streams only the tokens after the ones it resumes from."""

from __future__ import annotations

import grpc
import pytest
from fairserve.v1 import scheduler_pb2

from common.transport.grpc_server import REJECTION_KEY
from services.gateway.requests.backend import SchedulerLost, Unavailable
from services.gateway.convert import backend_error_from_rpc
from services.scheduler.workers.epochs import EpochClock

from tests.unit.scheduler.fake_worker import reference_output
from tests.unit.scheduler.test_transport import PROMPT, _request, make_stack  # noqa: F401 (a fixture)


def test_epochs_only_grow() -> None:
    now = iter([500, 500, 499, 800])
    clock = EpochClock(lambda: next(now))
    assert [clock.next() for _ in range(4)] == [500, 501, 502, 800]
    behind = EpochClock(lambda: 500)        # a clock behind the scheduler before it
    assert behind.next(after=900) == 901 and behind.next() == 902


async def test_each_registration_begins_a_larger_epoch_that_its_steps_carry(make_stack) -> None:
    stack = await make_stack()
    worker = await stack.add_worker()
    first = worker.epoch
    assert first > 0
    assert len([e async for e in stack.stub.Generate(_request("a"), timeout=10)]) == 5
    assert set(worker.servicer.epochs) == {first}
    again = await stack.stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(
        worker_id=worker.worker_id, address=worker.address), timeout=5)
    assert again.epoch > first
    worker.servicer.epochs.clear()
    assert len([e async for e in stack.stub.Generate(_request("b"), timeout=10)]) == 5
    assert set(worker.servicer.epochs) == {again.epoch}


async def test_refusals_are_marked_as_the_schedulers_own(make_stack) -> None:
    stack = await make_stack()
    with pytest.raises(grpc.aio.AioRpcError) as no_worker:
        await anext(aiter(stack.stub.Generate(_request("a"), timeout=5)))
    assert no_worker.value.code() is grpc.StatusCode.UNAVAILABLE
    assert (REJECTION_KEY, "no_worker") in tuple(no_worker.value.trailing_metadata())
    error = backend_error_from_rpc(no_worker.value)
    assert isinstance(error, Unavailable) and not isinstance(error, SchedulerLost)


async def test_a_continuation_streams_only_what_follows_its_resumed_tokens(make_stack) -> None:
    stack = await make_stack()
    worker = await stack.add_worker()
    expected = reference_output(PROMPT, 7)
    request = _request("c", max_tokens=7, resume_token_ids=expected[:3])
    events = [e async for e in stack.stub.Generate(request, timeout=10)]
    assert [t.token_id for e in events for t in e.tokens] == expected[3:]
    usage = events[-1].finish.usage
    assert (events[-1].finish.finish_reason, usage.prompt_tokens, usage.completion_tokens) == \
        ("length", len(PROMPT), 7)
    [new] = [n for step in worker.engine.steps for n in step.new_sequences]
    assert new.output_token_ids == tuple(expected[:3])
