"""The scheduler tells the gateway what model its workers serve (context
length, vocabulary size), from the workers' own Info at registration, and the
KV policy a request that names none gets (KV_POLICY)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2

from common.transport.grpc_server import insecure_channel

from services.scheduler.convert import model_info_to_proto
from services.scheduler.server import SchedulerServer
from services.scheduler.settings import SchedulerSettings

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.fake_worker_server import FakeWorkerProcess

SETTINGS = SchedulerSettings(port=0, metrics_port=0, kvcache_addr="127.0.0.1:9",
                             worker_heartbeat_timeout_s=0.6)
FAKE_VOCAB = 1000  # what the fake worker server reports


def test_no_worker_is_zeros() -> None:
    assert model_info_to_proto([]) == scheduler_pb2.ModelInfo(max_model_len=0, vocab_size=0, default_kv_policy="full")


def test_the_deployment_kv_policy_is_reported() -> None:
    assert model_info_to_proto([], "sink").default_kv_policy == "sink"


def test_workers_that_differ_give_the_smallest_values() -> None:
    infos = [worker_pb2.WorkerInfo(max_model_len=4096, vocab_size=512),
             worker_pb2.WorkerInfo(max_model_len=1024, vocab_size=640),
             worker_pb2.WorkerInfo(max_model_len=0, vocab_size=0)]  # says nothing
    assert model_info_to_proto(infos) == scheduler_pb2.ModelInfo(max_model_len=1024, vocab_size=512,
                                                                 default_kv_policy="full")


@pytest.fixture
async def scheduler() -> AsyncIterator[tuple[SchedulerServer, scheduler_pb2_grpc.SchedulerStub]]:
    server = SchedulerServer(SETTINGS)
    await server.start()
    channel = insecure_channel(f"127.0.0.1:{server.port}")
    yield server, scheduler_pb2_grpc.SchedulerStub(channel)
    await channel.close()
    await server.stop(0)


async def test_model_info_follows_the_registered_workers(scheduler) -> None:
    server, stub = scheduler
    address = f"127.0.0.1:{server.port}"

    async def info() -> scheduler_pb2.ModelInfo:
        return await stub.GetModelInfo(scheduler_pb2.ModelInfoRequest(), timeout=5)

    assert await info() == scheduler_pb2.ModelInfo(default_kv_policy="full")
    long_context = FakeWorkerProcess(FakeEngine(max_model_len=4096), "w0", address)
    short_context = FakeWorkerProcess(FakeEngine(max_model_len=256), "w1", address)
    await long_context.start()
    try:
        assert await info() == scheduler_pb2.ModelInfo(max_model_len=4096, vocab_size=FAKE_VOCAB,
                                                       default_kv_policy="full")
        await short_context.start()
        assert (await info()).max_model_len == 256
        short_context.stop_heartbeats()  # the silent worker leaves; so does its limit
        deadline = asyncio.get_running_loop().time() + 5
        while (await info()).max_model_len != 4096:
            assert asyncio.get_running_loop().time() < deadline, "the silent worker stayed"
            await asyncio.sleep(0.05)
    finally:
        await short_context.stop()
        await long_context.stop()
