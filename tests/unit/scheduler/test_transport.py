"""The real gRPC scheduler against fake worker gRPC servers."""

from __future__ import annotations

import logging

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import grpc
import pytest
from fairserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from prometheus_client import generate_latest

from common.transport.grpc_server import REJECTION_KEY, check_health, insecure_channel

from services.scheduler.server import SchedulerServer
from services.scheduler.settings import SchedulerSettings

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.fake_worker_server import FakeWorkerProcess

PROMPT = tuple(range(40, 52))
BASE = SchedulerSettings(port=0, metrics_port=0, kvcache_addr="127.0.0.1:9",
                         worker_heartbeat_timeout_s=0.6)


class Stack:
    def __init__(self, server: SchedulerServer, channel: grpc.aio.Channel) -> None:
        self.server = server
        self.channel = channel
        self.stub = scheduler_pb2_grpc.SchedulerStub(channel)
        self.workers: list[FakeWorkerProcess] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def add_worker(self, worker_id: str = "w0", step_delay_s: float = 0.002,
                         engine: FakeEngine | None = None) -> FakeWorkerProcess:
        worker = FakeWorkerProcess(engine or FakeEngine(num_blocks=1024), worker_id, self.address, step_delay_s)
        await worker.start()
        self.workers.append(worker)
        return worker

    async def stats(self) -> scheduler_pb2.SchedulerStats:
        return await self.stub.Stats(common_pb2.StatsRequest(), timeout=5)


@pytest.fixture
async def make_stack() -> AsyncIterator[Callable[..., object]]:
    stacks: list[Stack] = []

    async def make(**overrides: object) -> Stack:
        server = SchedulerServer(replace(BASE, **overrides))
        await server.start()
        stack = Stack(server, insecure_channel(f"127.0.0.1:{server.port}"))
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        for worker in stack.workers:
            await worker.stop()
        await stack.channel.close()
        await stack.server.stop(0)


def _request(request_id: str, max_tokens: int = 5, **fields: object) -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                         max_tokens=max_tokens, **fields)


async def _eventually(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def _wait_for_stats(stack: Stack, condition: Callable[[scheduler_pb2.SchedulerStats], bool],
                          timeout_s: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition(await stack.stats()):
        assert asyncio.get_running_loop().time() < deadline, f"stats never got there: {await stack.stats()}"
        await asyncio.sleep(0.01)


async def test_generate_streams_one_event_per_token_then_finish(make_stack) -> None:
    stack = await make_stack()
    await stack.add_worker()
    assert await check_health(stack.channel)
    request = _request("r1", sampling=common_pb2.SamplingParams(logprobs=True))
    events = [e async for e in stack.stub.Generate(request, timeout=10)]
    assert [len(e.tokens) for e in events] == [1] * 5
    assert [e.tokens[0].token_id for e in events] == reference_output(PROMPT, 5)
    assert all(e.tokens[0].logprob.logprob == pytest.approx(-0.5) for e in events)
    assert [e.HasField("finish") for e in events] == [False] * 4 + [True]
    finish = events[-1].finish
    assert finish.finish_reason == "length"
    assert (finish.usage.prompt_tokens, finish.usage.completion_tokens) == (12, 5)
    stats = await stack.stats()
    assert stats.finished == 1 and stats.admitted == 1 and stats.policy == "auto"
    assert [w.worker_id for w in stats.workers] == ["w0"] and stats.workers[0].steps >= 5
    await _eventually(lambda: b"fairserve_scheduler_admitted_total 1.0" in
                      generate_latest(stack.server.metrics.registry))


async def test_a_caller_asking_for_packed_tokens_gets_them_packed_unless_they_carry_logprobs(make_stack) -> None:
    stack = await make_stack()
    await stack.add_worker()
    plain, with_logprobs = _request("r1"), _request("r2", sampling=common_pb2.SamplingParams(logprobs=True))
    plain.packed_tokens = with_logprobs.packed_tokens = True
    events = [e async for e in stack.stub.Generate(plain, timeout=10)]
    assert [t for e in events for t in e.token_ids] == reference_output(PROMPT, 5)
    assert not any(e.tokens for e in events)
    events = [e async for e in stack.stub.Generate(with_logprobs, timeout=10)]
    assert [e.tokens[0].token_id for e in events] == reference_output(PROMPT, 5) and not any(e.token_ids for e in events)
    assert all(e.tokens[0].logprob.logprob == pytest.approx(-0.5) for e in events)


async def test_rejections_carry_the_right_status(make_stack) -> None:
    stack = await make_stack(max_queue_len=1, max_batch_size=1)
    with pytest.raises(grpc.aio.AioRpcError) as no_worker:
        await anext(aiter(stack.stub.Generate(_request("a"), timeout=5)))
    assert no_worker.value.code() is grpc.StatusCode.UNAVAILABLE
    worker = await stack.add_worker()
    with pytest.raises(grpc.aio.AioRpcError) as never_fit:
        await anext(aiter(stack.stub.Generate(_request("b", max_tokens=5000), timeout=5)))
    assert never_fit.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "4096" in never_fit.value.details()
    worker.servicer.running.clear()  # steps hang: one request runs, one waits
    # One at a time: "c" must leave the queue before "d" takes its one place, and "d"
    # must hold it before "e" comes (else "e" queues and waits out its deadline).
    running = stack.stub.Generate(_request("c"), timeout=10)
    await _wait_for_stats(stack, lambda s: s.pending == 0 and s.prefilling + s.active == 1)
    waiting = stack.stub.Generate(_request("d"), timeout=10)
    await _wait_for_stats(stack, lambda s: s.pending == 1 and s.prefilling + s.active == 1)
    with pytest.raises(grpc.aio.AioRpcError) as queue_full:
        await anext(aiter(stack.stub.Generate(_request("e"), timeout=5)))
    assert queue_full.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    worker.servicer.running.set()
    assert len([e async for e in running]) == 5 and len([e async for e in waiting]) == 5


async def test_a_tenants_quota_holds_across_callers_and_says_when_to_retry(make_stack) -> None:
    """Two callers (two gateways) send one tenant's requests: the scheduler counts them
    together, and refuses the third in flight with RESOURCE_EXHAUSTED, its gate and a
    retry-after; a token budget refusal says the seconds its refill takes."""
    stack = await make_stack()
    worker = await stack.add_worker()
    other = insecure_channel(stack.address)
    try:
        second = scheduler_pb2_grpc.SchedulerStub(other)
        quota = scheduler_pb2.TenantQuota(max_in_flight=2, tokens_per_minute=60)
        fields = dict(client_id="alice", authenticated=True, quota=quota)
        worker.servicer.running.clear()  # steps hang: both stay in flight
        running = [stub.Generate(_request(rid, **fields), timeout=10)
                   for stub, rid in ((stack.stub, "a1"), (second, "a2"))]
        await _wait_for_stats(stack, lambda s: s.pending + s.prefilling + s.active == 2)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await anext(aiter(second.Generate(_request("a3", **fields), timeout=5)))
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 generations in flight" in refused.value.details()
        metadata = tuple(refused.value.trailing_metadata())
        assert ("retry-after", "1") in metadata and (REJECTION_KEY, "quota") in metadata
        worker.servicer.running.set()
        for call in running:
            assert len([e async for e in call]) == 5
        # 2 x (12 prompt + 5 output) of 60 spent: 26 left; 12 + 20 more leaves 6 in debt,
        # so the next 12-token prompt waits about 18 s of refill (one token a second).
        assert len([e async for e in stack.stub.Generate(_request("a4", 20, **fields), timeout=10)]) == 20
        with pytest.raises(grpc.aio.AioRpcError) as budget:
            await anext(aiter(second.Generate(_request("a5", **fields), timeout=5)))
        assert budget.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "60 tokens a minute" in budget.value.details()
        assert 10 <= int(dict(budget.value.trailing_metadata())["retry-after"]) <= 19
    finally:
        await other.close()


async def test_a_held_request_times_out_as_unavailable(make_stack) -> None:
    stack = await make_stack(max_active_kv_tokens=30, queue_timeout_s=0.3)
    worker = await stack.add_worker()
    worker.servicer.running.clear()
    running = stack.stub.Generate(_request("long", max_tokens=18), timeout=10)  # reserves 30
    await _wait_for_stats(stack, lambda s: s.prefilling + s.active == 1)
    held = stack.stub.Generate(_request("held"), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as timed_out:
        await anext(aiter(held))
    assert timed_out.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "QUEUE_TIMEOUT_S" in timed_out.value.details()
    worker.servicer.running.set()
    assert len([e async for e in running]) == 18
    stats = await stack.stats()
    assert stats.rejections["timeout"] == 1


async def test_cancel_ends_the_stream_and_frees_the_sequence(make_stack) -> None:
    stack = await make_stack()
    worker = await stack.add_worker(step_delay_s=0.01)
    call = stack.stub.Generate(_request("long", max_tokens=1000), timeout=10)
    stream = aiter(call)
    first = [await anext(stream) for _ in range(3)]
    assert all(len(e.tokens) == 1 for e in first)
    reply = await stack.stub.Cancel(scheduler_pb2.CancelRequest(request_id="long"), timeout=5)
    assert reply.found
    rest = [e async for e in stream]
    assert rest[-1].finish.finish_reason == "cancelled"
    await _eventually(lambda: not worker.engine.seqs)
    assert worker.engine.pool().used_blocks == 0
    missing = await stack.stub.Cancel(scheduler_pb2.CancelRequest(request_id="long"), timeout=5)
    assert not missing.found


async def test_a_client_disconnect_frees_the_sequence(make_stack) -> None:
    stack = await make_stack()
    worker = await stack.add_worker(step_delay_s=0.01)
    call = stack.stub.Generate(_request("gone", max_tokens=1000), timeout=10)
    stream = aiter(call)
    await anext(stream)
    await _eventually(lambda: bool(worker.engine.seqs))
    call.cancel()
    await _eventually(lambda: not worker.engine.seqs)
    stats = await stack.stats()
    assert stats.active == 0 and dict(stats.rejections) == {}


async def test_a_worker_that_goes_away_ends_its_requests_with_an_error(make_stack) -> None:
    stack = await make_stack(worker_recovery_s=0)   # recovery off: they end at once
    worker = await stack.add_worker(step_delay_s=0.01)
    stream = aiter(stack.stub.Generate(_request("doomed", max_tokens=1000), timeout=10))
    await anext(stream)
    await worker.stop()  # Step now fails
    events = [e async for e in stream]
    finish = events[-1].finish
    assert finish.finish_reason == "error" and "w0" in finish.message
    assert finish.usage.completion_tokens >= 1
    stats = await stack.stats()
    assert not stats.workers
    stack.workers.clear()


async def test_a_worker_that_stops_heartbeating_leaves_the_rotation(make_stack) -> None:
    stack = await make_stack(worker_recovery_s=0)   # recovery off: they end at once
    worker = await stack.add_worker(step_delay_s=0.01)
    stream = aiter(stack.stub.Generate(_request("stuck", max_tokens=1000), timeout=10))
    await anext(stream)
    worker.servicer.running.clear()  # hung in a step...
    worker.stop_heartbeats()         # ...and silent
    events = [e async for e in stream]
    finish = events[-1].finish
    assert finish.finish_reason == "error" and "heartbeat" in finish.message
    assert not (await stack.stats()).workers
    reply = await stack.stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="w0"), timeout=5)
    assert not reply.known  # told to register again
    worker.servicer.running.set()


async def test_two_workers_share_the_load(make_stack) -> None:
    stack = await make_stack()
    first = await stack.add_worker("w0")
    second = await stack.add_worker("w1")
    calls = [stack.stub.Generate(_request(f"r{i}", max_tokens=4), timeout=10) for i in range(4)]
    results = await asyncio.gather(*[_collect(c) for c in calls])
    assert all([e.tokens[0].token_id for e in r] == reference_output(PROMPT, 4) for r in results)
    assert first.engine.steps and second.engine.steps  # the index is down: least loaded wins


async def _collect(call) -> list[scheduler_pb2.GenerateEvent]:
    return [e async for e in call]


async def _generate_three(stack: Stack) -> None:
    calls = [stack.stub.Generate(_request(f"r{n}", max_tokens=6 + n), timeout=10) for n in range(3)]
    for n, call in enumerate(calls):
        events = [e async for e in call]
        assert [e.tokens[0].token_id for e in events] == reference_output(PROMPT, 6 + n)


async def test_async_scheduling_sends_the_next_step_while_one_runs(make_stack) -> None:
    stack = await make_stack()          # ASYNC_SCHEDULING defaults to on
    worker = await stack.add_worker(step_delay_s=0.01)
    await _generate_three(stack)
    executed = worker.servicer.executed
    assert [step for step, _ in executed] == sorted(step for step, _ in executed)
    pipelined = [after for _, after in executed if after]
    assert len(pipelined) >= len(executed) // 2, executed   # most steps were sent before the last one ended
    for (previous, _), (_, after) in zip(executed, executed[1:]):
        assert after in (0, previous)                       # each runs right after the one it names
    await _eventually(lambda: not worker.engine.seqs)


async def test_a_worker_gets_its_steps_over_one_stream(make_stack) -> None:
    stack = await make_stack()          # STEP_TRANSPORT defaults to stream
    worker = await stack.add_worker(step_delay_s=0.005)
    await _generate_three(stack)
    assert worker.servicer.calls == {"StepStream": 1}
    assert len(worker.servicer.executed) >= 8      # the longest request's tokens, each a step


async def test_the_unary_transport_sends_a_call_per_step(make_stack) -> None:
    stack = await make_stack(step_transport="unary")
    worker = await stack.add_worker(step_delay_s=0.005)
    await _generate_three(stack)
    # A step sent after the last token may still be arriving: every call is a step once it runs.
    await _eventually(lambda: worker.servicer.calls == {"Step": len(worker.servicer.executed)})
    assert any(after for _, after in worker.servicer.executed)     # pipelined as over the stream


async def test_sync_scheduling_waits_for_each_step(make_stack) -> None:
    stack = await make_stack(async_scheduling=False)
    worker = await stack.add_worker(step_delay_s=0.005)
    await _generate_three(stack)
    assert worker.servicer.executed and all(after == 0 for _, after in worker.servicer.executed)


class _Context:
    """The little of a servicer context Generate reads before its first event."""

    def invocation_metadata(self) -> tuple:
        return ()


async def test_a_client_closing_after_the_last_event_did_not_cancel(make_stack, caplog) -> None:
    # grpc stops iterating the handler once the client closes the call, so the generator may
    # never resume after yielding the finish: the finish is logged before it is yielded.
    stack = await make_stack()
    await stack.add_worker()
    events = stack.server.service.Generate(_request("done", max_tokens=3), _Context())
    with caplog.at_level(logging.INFO, logger="services.scheduler.server"):
        async for event in events:
            if event.HasField("finish"):
                break
        await events.aclose()
    messages = [record.getMessage() for record in caplog.records]
    assert "request finished" in messages and "request cancelled by the client" not in messages
