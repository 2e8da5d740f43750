"""A request's cache salt through the real gRPC scheduler: its KV-index lookup carries the
salt, and so does the sequence sent to the worker, whose prefix cache only serves the
same salt's requests. With one worker the index is not asked (nothing to route): each request's
lookup is recorded when it ends, from what the worker reused (lookup_records.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from fairserve.v1 import kvindex_pb2, kvindex_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from common.transport.grpc_server import GrpcServer, insecure_channel
from services.scheduler.server import SchedulerServer
from services.scheduler.settings import SchedulerSettings

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.fake_worker_server import FakeWorkerProcess

PROMPT = tuple(range(40, 60))   # five blocks of 4


class RecordingIndex(kvindex_pb2_grpc.KvIndexServicer):
    """A KV index that knows nothing and remembers what it was asked."""

    def __init__(self) -> None:
        self.lookups: list[kvindex_pb2.LookupRequest] = []
        self.recorded: list[kvindex_pb2.RecordedLookup] = []

    async def Lookup(self, request: kvindex_pb2.LookupRequest,
                     context: grpc.aio.ServicerContext) -> kvindex_pb2.LookupResponse:
        self.lookups.append(request)
        return kvindex_pb2.LookupResponse(block_size=4)

    async def RecordLookups(self, request: kvindex_pb2.RecordLookupsRequest,
                            context: grpc.aio.ServicerContext) -> kvindex_pb2.RecordLookupsResponse:
        self.recorded.extend(request.lookups)
        return kvindex_pb2.RecordLookupsResponse()


async def _index_and_scheduler() -> tuple[RecordingIndex, GrpcServer, SchedulerServer]:
    """A recording index and a real scheduler that asks it."""
    index = RecordingIndex()
    index_server = GrpcServer([(kvindex_pb2_grpc.add_KvIndexServicer_to_server, index)],
                              ["fairserve.v1.KvIndex"], "127.0.0.1", 0)
    await index_server.start()
    server = SchedulerServer(SchedulerSettings(port=0, metrics_port=0, kvcache_addr=f"127.0.0.1:{index_server.port}"))
    await server.start()
    return index, index_server, server


@pytest.fixture
async def stack() -> AsyncIterator[tuple[scheduler_pb2_grpc.SchedulerStub, RecordingIndex, FakeEngine]]:
    index, index_server, server = await _index_and_scheduler()
    worker = FakeWorkerProcess(FakeEngine(), "w0", f"127.0.0.1:{server.port}")
    await worker.start()
    channel = insecure_channel(f"127.0.0.1:{server.port}")
    yield scheduler_pb2_grpc.SchedulerStub(channel), index, worker.engine
    await worker.stop()
    await channel.close()
    await server.stop(0)
    await index_server.stop(0)


async def _cached_tokens(stub: scheduler_pb2_grpc.SchedulerStub, request_id: str, salt: str) -> int:
    request = scheduler_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT, max_tokens=2,
                                            cache_salt=salt)
    events = [event async for event in stub.Generate(request, timeout=10)]
    return events[-1].finish.usage.cached_tokens


async def test_the_salt_reaches_the_index_lookup_and_the_worker(stack) -> None:
    stub, index, engine = stack
    assert await _cached_tokens(stub, "a1", "tenant-a") == 0
    assert await _cached_tokens(stub, "b1", "tenant-b") == 0
    assert await _cached_tokens(stub, "a2", "tenant-a") == 16
    assert await _cached_tokens(stub, "plain", "") == 0
    sent = [new.cache_salt for step in engine.steps for new in step.new_sequences]
    assert sent == ["tenant-a", "tenant-b", "tenant-a", ""]
    for _ in range(300):        # recorded together, every half second
        if len(index.recorded) == 4:
            break
        await asyncio.sleep(0.01)
    assert index.lookups == []
    assert [(r.prompt_tokens, r.cached_tokens, r.request_id) for r in index.recorded] == [
        (len(PROMPT), 0, "a1"), (len(PROMPT), 0, "b1"), (len(PROMPT), 16, "a2"), (len(PROMPT), 0, "plain")]


async def test_a_gateways_index_answer_routes_the_request_without_a_second_lookup() -> None:
    """A gateway over shards asked the index to pick the shard (index_asked): the scheduler
    routes by that answer among its two workers and does not ask the index again; a request
    without it is looked up, under its salt."""
    index, index_server, server = await _index_and_scheduler()
    workers = [FakeWorkerProcess(FakeEngine(), worker_id, f"127.0.0.1:{server.port}") for worker_id in ("w0", "w1")]
    channel = insecure_channel(f"127.0.0.1:{server.port}")
    try:
        for worker in workers:
            await worker.start()
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for name in ("w0", "w1"):        # each worker's claimed prefix sends the request to it
            request = scheduler_pb2.GenerateRequest(request_id=f"to-{name}", prompt_token_ids=PROMPT, max_tokens=1,
                                                    index_asked=True, cached_prefix_tokens={name: 16})
            [event async for event in stub.Generate(request, timeout=10)]
            (engine,) = [worker.engine for worker in workers if worker.worker_id == name]
            assert any(new.seq_id.startswith(f"to-{name}") for step in engine.steps for new in step.new_sequences)
        assert index.lookups == []
        salted = scheduler_pb2.GenerateRequest(request_id="salted", prompt_token_ids=PROMPT, max_tokens=1,
                                               cache_salt="tenant-a")
        [event async for event in stub.Generate(salted, timeout=10)]
        assert [(tuple(lookup.token_ids), lookup.cache_salt) for lookup in index.lookups] == [(PROMPT, "tenant-a")]
        assert index.recorded == []      # asked: nothing to record
    finally:
        for worker in workers:
            await worker.stop()
        await channel.close()
        await server.stop(0)
        await index_server.stop(0)
