"""The real gRPC server: Publish, Lookup, Stats and health through a client,
and `python -m services.kvcache.main` as a process."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from fairserve.v1 import kvindex_pb2, kvindex_pb2_grpc

from common.block_hash import prompt_hashes
from common.observability.logs import request_id_var
from common.transport.grpc_server import GrpcServer, check_health, insecure_channel
from services.kvcache.stores.backend import MemoryBackend
from services.kvcache.client import KvIndexClient
from services.kvcache.kv_types import (
    BlockStored, KvEvent, LookupQuery, PublishBatch, PublishResult, RecordedLookup,
)
from services.kvcache.publisher import KvEventPublisher
from services.kvcache.server import SERVICE_NAME, build_server
from services.kvcache.service import KvIndexService
from services.gateway.streaming.scheduler_client import SchedulerClient
from services.scheduler.kv_router import KvIndexRouter

ROOT = Path(__file__).resolve().parents[3]
BLOCK = 4
MODEL_KEY = "tiny"
PROMPT = list(range(1, 15))  # three full blocks and two tokens


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
async def server() -> AsyncIterator[GrpcServer]:
    service = KvIndexService(MemoryBackend(BLOCK), MODEL_KEY)
    instance = build_server(service, "127.0.0.1", 0)
    await instance.start()
    await instance.set_serving(True)
    yield instance
    await instance.stop(0)


@pytest.fixture
async def client(server: GrpcServer) -> AsyncIterator[KvIndexClient]:
    instance = KvIndexClient.connect(f"127.0.0.1:{server.port}")
    yield instance
    await instance.close()


def prompt_chain() -> BlockStored:
    hashes = prompt_hashes(PROMPT, BLOCK, MODEL_KEY)
    return BlockStored(0, hashes.block_hashes, hashes.partial_hash)


async def test_health_reports_serving(server: GrpcServer) -> None:
    async with insecure_channel(f"127.0.0.1:{server.port}") as channel:
        assert await check_health(channel)
        assert await check_health(channel, SERVICE_NAME)


async def test_publish_lookup_stats_over_grpc(client: KvIndexClient) -> None:
    publisher = KvEventPublisher("worker-0", client.publish, lambda: [])
    assert await publisher.flush()  # joins with an empty snapshot
    chain = prompt_chain()
    publisher.stored(chain.parent_hash, chain.block_hashes, chain.partial_hash)
    assert await publisher.flush()

    exact = await client.lookup_tokens(PROMPT)
    assert exact.block_size == BLOCK
    assert [(m.worker_id, m.matched_blocks, m.matched_tokens, m.exact) for m in exact.matches] == \
        [("worker-0", 3, len(PROMPT), True)]
    longer = await client.lookup_tokens(PROMPT[:12] + [99, 98, 97, 96, 95])
    assert [(m.matched_blocks, m.matched_tokens, m.exact) for m in longer.matches] == \
        [(3, 12, False)]
    by_hash = prompt_hashes(PROMPT[:8], BLOCK, MODEL_KEY)
    partial = await client.lookup(LookupQuery(by_hash.block_hashes))
    assert partial.best is not None and partial.best.matched_tokens == 8

    stats = await client.stats()
    assert stats.backend == "memory"
    assert (stats.lookups, stats.hits, stats.hit_tokens) == (3, 3, 14 + 12 + 8)
    assert stats.lookup_tokens == 14 + 17 + 8
    assert stats.blocks_by_worker == {"worker-0": 3}
    assert stats.events == 1 and stats.resyncs == 1 and stats.nodes == 1


async def test_the_scheduler_and_the_gateway_ask_through_the_same_client(
        server: GrpcServer, client: KvIndexClient) -> None:
    publisher = KvEventPublisher("worker-0", client.publish, lambda: [prompt_chain()])
    assert await publisher.flush()
    address = f"127.0.0.1:{server.port}"
    router = KvIndexRouter(address, lambda: 0.0)
    gateway = SchedulerClient("127.0.0.1:1", address)   # no scheduler: only its kvcache probe
    try:
        assert await router.cached_prefix_tokens(PROMPT) == {"worker-0": len(PROMPT)}
        shown = await gateway.kvcache_stats()
    finally:
        await router.close()
        await gateway.close()
    assert shown == {"lookups": 1, "hits": 1, "lookup_tokens": len(PROMPT), "hit_tokens": len(PROMPT),
                     "hit_rate": 1.0, "nodes": 1, "events": 0, "resyncs": 1,
                     "blocks_by_worker": {"worker-0": 3}, "backend": "memory"}


async def test_lookup_many_answers_each_query_as_lookup_would(client: KvIndexClient, server: GrpcServer) -> None:
    publisher = KvEventPublisher("worker-0", client.publish, lambda: [prompt_chain()])
    assert await publisher.flush()
    other = PROMPT[:12] + [99, 98, 97, 96, 95]
    many = await client.lookup_many([(PROMPT, ""), (other, ""), (PROMPT, "another tenant")], ["a", "b", "c"])
    singles = [await client.lookup_tokens(PROMPT), await client.lookup_tokens(other),
               await client.lookup_tokens(PROMPT, cache_salt="another tenant")]
    assert many == singles and [len(result.matches) for result in singles] == [1, 1, 0]
    async with insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = kvindex_pb2_grpc.KvIndexStub(channel)
        mixed = await stub.LookupMany(kvindex_pb2.LookupManyRequest(queries=[
            kvindex_pb2.LookupRequest(block_hashes=[1], token_ids=[1]), kvindex_pb2.LookupRequest(token_ids=PROMPT)]))
        assert "not both" in mixed.results[0].error and mixed.results[1].matches[0].matched_tokens == len(PROMPT)
        for bad in (kvindex_pb2.LookupManyRequest(queries=[kvindex_pb2.LookupRequest(token_ids=[1])] * 1025),
                    kvindex_pb2.LookupManyRequest(queries=[kvindex_pb2.LookupRequest(token_ids=[1])],
                                                  request_ids=["a", "b"])):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.LookupMany(bad)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class _RequestIds(logging.Handler):
    """(message, cached tokens, the request id the log line takes) of each record, at emit time."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, object, str | None]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.getMessage(), getattr(record, "cached_tokens", None), request_id_var.get()))


async def test_recorded_lookups_over_grpc(client: KvIndexClient, server: GrpcServer) -> None:
    """RecordLookups counts each as a lookup and logs it under its request's id; more than a
    call's limit, or more cached tokens than the prompt has, is refused and counts nothing."""
    handler, logger = _RequestIds(), logging.getLogger("services.kvcache.server")
    logger.addHandler(handler)
    # (Another test's logging set-up may have turned existing loggers off.)
    level, disabled, logger.disabled = logger.level, logger.disabled, False
    logger.setLevel(logging.INFO)
    try:
        await client.record_lookups([RecordedLookup(20, 16, "req-1"), RecordedLookup(20, 0, "req-2"),
                                     RecordedLookup(8, 0)])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
    stats = await client.stats()
    assert (stats.lookups, stats.hits, stats.lookup_tokens, stats.hit_tokens) == (3, 1, 48, 16)
    assert [line for line in handler.lines if line[0] == "lookup"] == [
        ("lookup", 16, "req-1"), ("lookup", 0, "req-2"), ("lookup", 0, None)]    # no id: not the one before
    async with insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = kvindex_pb2_grpc.KvIndexStub(channel)
        for bad in (kvindex_pb2.RecordLookupsRequest(lookups=[kvindex_pb2.RecordedLookup(prompt_tokens=1)] * 1025),
                    kvindex_pb2.RecordLookupsRequest(lookups=[kvindex_pb2.RecordedLookup(prompt_tokens=4,
                                                                                         cached_tokens=5)])):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RecordLookups(bad)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await client.stats()).lookups == 3


async def test_gap_over_grpc_answers_resync_needed(client: KvIndexClient) -> None:
    await client.publish(PublishBatch("w", full_resync=True))
    reply = await client.publish(PublishBatch("w", (KvEvent(2, prompt_chain()),)))
    assert reply == PublishResult(True, 1)


async def test_bad_requests_are_invalid_argument(server: GrpcServer) -> None:
    async with insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = kvindex_pb2_grpc.KvIndexStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as both:
            await stub.Lookup(kvindex_pb2.LookupRequest(block_hashes=[1], token_ids=[1]))
        assert both.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as zero_hash:
            await stub.Publish(kvindex_pb2.PublishRequest(
                worker_id="w", full_resync=True,
                snapshot=[kvindex_pb2.BlockStored(block_hashes=[0])]))
        assert zero_hash.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as no_worker:
            await stub.Publish(kvindex_pb2.PublishRequest(full_resync=True))
        assert no_worker.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class ServiceProcess:
    def __init__(self, env: dict[str, str]) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        full_env = {**os.environ, **env, "KVCACHE_PORT": str(self.port),
                    "KVCACHE_METRICS_PORT": str(self.metrics_port),
                    "KV_CACHE_BLOCK_SIZE": str(BLOCK), "MODEL_KEY": MODEL_KEY}
        self.process = subprocess.Popen([sys.executable, "-m", "services.kvcache.main"], cwd=ROOT,
                                        env=full_env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT)

    async def wait_serving(self, timeout_s: float = 15.0) -> None:
        async with insecure_channel(f"127.0.0.1:{self.port}") as channel:
            for _ in range(int(timeout_s / 0.1)):
                if self.process.poll() is not None:
                    output = self.process.stdout.read().decode() if self.process.stdout else ""
                    raise RuntimeError(f"kvcache exited early:\n{output}")
                if await check_health(channel, timeout_s=0.5):
                    return
                await asyncio.sleep(0.1)
        raise TimeoutError("kvcache did not become healthy")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=10)


async def test_main_serves_metrics_and_stops_cleanly() -> None:
    service = ServiceProcess({"KV_INDEX_BACKEND": "memory"})
    try:
        await service.wait_serving()
        client = KvIndexClient.connect(f"127.0.0.1:{service.port}")
        await client.lookup_tokens(PROMPT)
        await client.close()
        metrics = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics",
                                           timeout=2).read().decode())
        assert "fairserve_kvcache_lookups_total 1.0" in metrics
    finally:
        assert service.stop() == 0


async def test_redis_backed_service_survives_a_restart(redis_url: str) -> None:
    env = {"KV_INDEX_BACKEND": "redis", "REDIS_URL": redis_url}
    first = ServiceProcess(env)
    try:
        await first.wait_serving()
        client = KvIndexClient.connect(f"127.0.0.1:{first.port}")
        publisher = KvEventPublisher("worker-0", client.publish, lambda: [prompt_chain()])
        assert await publisher.flush()
        await client.close()
    finally:
        assert first.stop() == 0
    second = ServiceProcess(env)
    try:
        await second.wait_serving()
        client = KvIndexClient.connect(f"127.0.0.1:{second.port}")
        result = await client.lookup_tokens(PROMPT)
        assert result.best is not None and result.best.exact
        assert (await client.stats()).backend == "redis"
        await client.close()
    finally:
        assert second.stop() == 0
