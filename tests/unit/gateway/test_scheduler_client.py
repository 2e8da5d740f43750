"""The gRPC scheduler client against in-process scheduler/worker servicers, with its
requests over one GenerateMany call (the default) and over a Generate call each: the
same events, refusals, losses and cancels either way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc
import pytest

from common.convert import sampling_from_proto
from common.transport.grpc_server import REJECTION_KEY, GrpcServer
from common.types import SamplingParams
from fairserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.gateway.convert import LOCAL_TRANSPORT_FAILURE, backend_error_from_status
from services.gateway.requests.backend import (
    BackendError,
    GenerationSpec,
    InvalidGeneration,
    ModelInfo,
    Overloaded,
    SchedulerLost,
    Unavailable,
)
from services.gateway.streaming.scheduler_client import SchedulerClient


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []
        self.requests: list[scheduler_pb2.GenerateRequest] = []
        self.cancelled_streams = 0
        self.cancel_ids: list[str] = []
        self.worker_address = ""
        self.model_info_calls = 0

    async def Generate(self, request: scheduler_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.GenerateEvent]:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if request.client_id == "busy":
            context.set_trailing_metadata((("retry-after", "5"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        if request.client_id == "quota":
            context.set_trailing_metadata((("retry-after", "9"), (REJECTION_KEY, "quota")))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "Tenant 'quota' is at its limit")
        if request.client_id == "held":
            context.set_trailing_metadata((("retry-after", "7"), (REJECTION_KEY, "timeout")))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "soft hold timed out after 30 s")
        if request.client_id == "huge":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "needs 9000 tokens, max 4096")
        try:
            for index in range(request.max_tokens):
                logprob = common_pb2.TokenLogprob(logprob=-0.5, top=[common_pb2.TopLogprob(
                    token_id=10 + index, logprob=-0.5)])
                yield scheduler_pb2.GenerateEvent(tokens=[scheduler_pb2.TokenEvent(
                    token_id=10 + index, logprob=logprob)])
                await asyncio.sleep(0.01)
            yield scheduler_pb2.GenerateEvent(finish=scheduler_pb2.FinishEvent(
                finish_reason="length", usage=common_pb2.Usage(
                    prompt_tokens=len(request.prompt_token_ids),
                    completion_tokens=request.max_tokens, cached_tokens=2)))
        except asyncio.CancelledError:
            self.cancelled_streams += 1
            raise

    async def GenerateMany(self, request_iterator: AsyncIterator[scheduler_pb2.StreamRequest],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.StreamEvents]:
        """Each submit served by Generate above, its status made a refusal."""
        out: asyncio.Queue[scheduler_pb2.StreamEvent] = asyncio.Queue()
        tasks: dict[int, asyncio.Task[None]] = {}

        async def serve(submit: scheduler_pb2.StreamSubmit) -> None:
            stream_context = _StreamContext(submit)
            try:
                async for event in self.Generate(submit.request, stream_context):  # type: ignore[arg-type]
                    out.put_nowait(scheduler_pb2.StreamEvent(stream=submit.stream, event=event))
            except _Aborted as refusal:
                out.put_nowait(scheduler_pb2.StreamEvent(stream=submit.stream, refusal=scheduler_pb2.StreamRefusal(
                    code=refusal.code.value[0], message=refusal.message,
                    metadata=dict(stream_context.trailing))))

        async def read() -> None:
            async for message in request_iterator:
                for submit in message.submit:
                    tasks[submit.stream] = asyncio.create_task(serve(submit))
                for stream in message.cancel:
                    tasks[stream].cancel()

        reader = asyncio.create_task(read())
        try:
            while True:
                yield scheduler_pb2.StreamEvents(events=[await out.get()])
        finally:
            reader.cancel()

    async def Cancel(self, request: scheduler_pb2.CancelRequest,
                     context: grpc.aio.ServicerContext) -> scheduler_pb2.CancelResponse:
        self.cancel_ids.append(request.request_id)
        return scheduler_pb2.CancelResponse(found=True)

    async def Stats(self, request: common_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerStats:
        workers = [scheduler_pb2.WorkerSummary(worker_id="w0", address=self.worker_address,
                                               healthy=True)] if self.worker_address else []
        return scheduler_pb2.SchedulerStats(pending=1, workers=workers, policy="fcfs")

    async def GetModelInfo(self, request: scheduler_pb2.ModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> scheduler_pb2.ModelInfo:
        self.model_info_calls += 1
        if not self.worker_address:
            return scheduler_pb2.ModelInfo()
        return scheduler_pb2.ModelInfo(max_model_len=777, vocab_size=384, default_kv_policy="sink")


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


class _StreamContext:
    """What Generate above asks of its context, for a GenerateMany stream."""

    def __init__(self, submit: scheduler_pb2.StreamSubmit) -> None:
        self._metadata = (("x-request-id", submit.trace_id),)
        self.trailing: tuple[tuple[str, str], ...] = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise _Aborted(code, message)


@pytest.fixture(params=["multiplexed", "per_request"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[tuple[SchedulerClient, SchedulerServicer, GrpcServer]]:
    scheduler = SchedulerServicer()
    server = GrpcServer([(scheduler_pb2_grpc.add_SchedulerServicer_to_server, scheduler)],
                        ["fairserve.v1.Scheduler"], "127.0.0.1", 0)
    await server.start()
    await server.set_serving(True)
    address = f"127.0.0.1:{server.port}"
    # the same server answers the kvcache probe
    client = SchedulerClient(address, address, multiplexed=request.param == "multiplexed")
    yield client, scheduler, server
    await client.close()
    await server.stop(0)


def request(**overrides: Any) -> GenerationSpec:
    values: dict[str, Any] = dict(prompt_token_ids=(2, 5, 6), max_tokens=3,
                                  sampling=SamplingParams(temperature=0.5, seed=-1, logprobs=True,
                                                          top_logprobs=1),
                                  stop=("never sent",), client_id="alice")
    values.update(overrides)
    return GenerationSpec(**values)


async def test_generate_streams_plain_events_with_request_id_metadata(backend: Any) -> None:
    client, scheduler, _server = backend
    events = [event async for event in client.generate(request(), "r1.0", trace_id="r1")]
    assert [event.tokens[0].token_id for event in events[:-1]] == [10, 11, 12]
    assert client.scheduler_seen
    assert events[0].tokens[0].logprob.top[0].token_id == 10
    assert events[-1].finish.reason == "length"
    assert events[-1].finish.usage.cached_tokens == 2
    assert scheduler.metadata[0]["x-request-id"] == "r1"
    sent = scheduler.requests[0]
    assert sent.request_id == "r1.0" and sent.max_tokens == 3
    assert sent.client_id == "alice" and list(sent.prompt_token_ids) == [2, 5, 6]
    assert sent.sampling.seed == 2**64 - 1  # a negative seed survives as uint64
    assert sampling_from_proto(sent.sampling).temperature == pytest.approx(0.5)


async def test_rejections_become_backend_errors(backend: Any) -> None:
    client, _scheduler, _server = backend
    with pytest.raises(Overloaded) as busy:
        [event async for event in client.generate(request(client_id="busy"), "r1.0")]
    assert busy.value.retry_after_s == 5 and busy.value.code == "queue_full"
    with pytest.raises(Overloaded) as quota:   # a tenant's quota, held by the scheduler: 429 as the gateway's own
        [event async for event in client.generate(request(client_id="quota"), "r1.0")]
    assert quota.value.retry_after_s == 9 and quota.value.code == "tenant_quota_exceeded"
    with pytest.raises(Unavailable, match="hold") as held:
        [event async for event in client.generate(request(client_id="held"), "r1.0")]
    assert held.value.retry_after_s == 7
    assert not isinstance(held.value, SchedulerLost)   # the scheduler's own refusal
    with pytest.raises(InvalidGeneration, match="9000"):
        [event async for event in client.generate(request(client_id="huge"), "r1.0")]
    dead = SchedulerClient("127.0.0.1:1", "127.0.0.1:1")
    with pytest.raises(SchedulerLost):   # no scheduler there: worth waiting for once seen
        [event async for event in dead.generate(request(), "r1.0")]
    assert not dead.scheduler_seen
    down = await dead.readiness()
    assert not down.ready and down.degraded == ("scheduler", "kvcache")
    assert await dead.model_info() == ModelInfo()  # unreachable: unknown, asked again later
    await dead.close()


def test_a_connection_broken_mid_call_is_a_lost_scheduler_and_a_scheduler_fault_is_not() -> None:
    # gRPC's asyncio client makes this INTERNAL itself when the connection breaks under
    # a message in flight (seen when a scheduler was killed mid-stream): the request is
    # to be resumed, not failed. An INTERNAL the scheduler sends is a fault of its own.
    lost = backend_error_from_status(grpc.StatusCode.INTERNAL, LOCAL_TRANSPORT_FAILURE, ())
    assert isinstance(lost, SchedulerLost)
    fault = backend_error_from_status(grpc.StatusCode.INTERNAL, "index out of range", ())
    assert type(fault) is BackendError and "INTERNAL" in fault.message


async def test_closing_the_stream_cancels_the_rpc(backend: Any) -> None:
    client, scheduler, _server = backend
    async with aclosing(client.generate(request(max_tokens=500), "r1.0")) as events:
        await anext(events)
    # The cancel crosses the connection: on a loaded machine it took over a second to arrive.
    for _ in range(1000):
        if scheduler.cancelled_streams:
            break
        await asyncio.sleep(0.01)
    assert scheduler.cancelled_streams == 1
    assert await client.cancel("r1.0") and scheduler.cancel_ids == ["r1.0"]


async def test_readiness_needs_a_worker_and_only_reports_the_kvcache(backend: Any) -> None:
    client, scheduler, server = backend
    not_ready = await client.readiness()
    assert not not_ready.ready and "worker" in not_ready.reason
    scheduler.worker_address = f"127.0.0.1:{server.port}"
    ready = await client.readiness()     # this server has no index: serving goes on without it
    assert ready.ready and ready.dependencies == (("scheduler", True), ("kvcache", False))
    assert ready.degraded == ("kvcache",)
    assert (await client.scheduler_stats()).details["policy"] == "fcfs"


async def test_model_info_comes_from_the_scheduler_and_is_kept_once_known(backend: Any) -> None:
    client, scheduler, server = backend
    assert await client.model_info() == ModelInfo()  # no worker registered yet
    assert await client.model_info() == ModelInfo()  # so it asks again
    scheduler.worker_address = f"127.0.0.1:{server.port}"
    assert await client.model_info() == ModelInfo(max_model_len=777, vocab_size=384, default_kv_policy="sink")
    assert await client.model_info() == ModelInfo(max_model_len=777, vocab_size=384, default_kv_policy="sink")
    assert scheduler.model_info_calls == 3
