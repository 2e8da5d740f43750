"""The index going away and coming back: a restarted in-memory index is
rebuilt from the workers' resyncs (idle workers included), a Redis that is
stopped or black-holed makes lookups fail fast (and the scheduler route
without them), and publishing and lookups recover when Redis returns."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as redis

from common.block_hash import prompt_hashes
from common.settings.env import SettingsError
from services.kvcache.stores.backend import MemoryBackend
from services.kvcache.client import KvIndexClient
from services.kvcache.kv_types import BlockStored, LookupQuery, PublishBatch, PublishResult
from services.kvcache.publisher import KvEventPublisher
from services.kvcache.stores.redis_backend import RedisBackend
from services.kvcache.stores.redis_guard import RedisPaused
from services.kvcache.server import build_server
from services.kvcache.service import KvIndexService
from services.kvcache.settings import KvCacheSettings
from services.scheduler.kv_router import KvIndexRouter

from tests.fixtures.redis_server import free_port, redis_binary, wait_for_redis

BLOCK = 4
MODEL_KEY = "tiny"
PROMPT = list(range(1, 15))   # three full blocks and two tokens


def chain() -> BlockStored:
    hashes = prompt_hashes(PROMPT, BLOCK, MODEL_KEY)
    return BlockStored(0, hashes.block_hashes, hashes.partial_hash)


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.02)


async def knows_w0(service: KvIndexService) -> bool:
    try:
        result = await service.lookup_tokens(PROMPT)
    except redis.RedisError:
        return False
    return [(m.worker_id, m.matched_tokens) for m in result.matches] == [("w0", len(PROMPT))]


@contextlib.asynccontextmanager
async def publishing(send: Callable[[PublishBatch], Awaitable[PublishResult]]) -> AsyncIterator[KvEventPublisher]:
    """Worker w0, holding PROMPT's blocks, publishing with a short keepalive and nothing else to say."""
    publisher = KvEventPublisher("w0", send, lambda: [chain()], keepalive_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(0.02, stop, max_backoff_s=0.2))
    try:
        yield publisher
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5)


async def test_a_restarted_memory_index_gets_an_idle_workers_blocks_back() -> None:
    index = {"service": KvIndexService(MemoryBackend(BLOCK), MODEL_KEY)}

    async def send(batch: PublishBatch) -> PublishResult:
        return await index["service"].publish(batch)

    async with publishing(send) as publisher:
        await eventually(lambda: knows_w0(index["service"]))
        index["service"] = KvIndexService(MemoryBackend(BLOCK), MODEL_KEY)   # restarted: empty
        assert not await knows_w0(index["service"])
        await eventually(lambda: knows_w0(index["service"]))
    assert publisher.resyncs_sent == 2


async def test_a_probe_to_an_index_that_lost_the_worker_brings_the_snapshot() -> None:
    sent: list[PublishBatch] = []
    service = KvIndexService(MemoryBackend(BLOCK), MODEL_KEY)

    async def send(batch: PublishBatch) -> PublishResult:
        sent.append(batch)
        return await service.publish(batch)

    publisher = KvEventPublisher("w0", send, lambda: [chain()])
    assert await publisher.flush() and len(sent) == 1 and sent[0].full_resync
    assert await publisher.flush() and len(sent) == 1             # nothing to say: nothing sent
    assert await publisher.flush(probe=True) and len(sent) == 2   # the index still knows w0
    service = KvIndexService(MemoryBackend(BLOCK), MODEL_KEY)
    assert await publisher.flush(probe=True)
    assert [batch.full_resync for batch in sent[2:]] == [False, True] and await knows_w0(service)


async def test_a_restarted_kvcache_server_is_rebuilt_over_grpc() -> None:
    port = free_port()
    first = KvIndexService(MemoryBackend(BLOCK), MODEL_KEY)
    server = build_server(first, "127.0.0.1", port)
    await server.start()
    client = KvIndexClient.connect(f"127.0.0.1:{port}", timeout_s=0.5)
    try:
        async with publishing(client.publish):
            await eventually(lambda: knows_w0(first))
            await server.stop(0)
            await asyncio.sleep(0.5)                               # down a while: publishes fail
            second = KvIndexService(MemoryBackend(BLOCK), MODEL_KEY)
            server = build_server(second, "127.0.0.1", port)
            await server.start()
            await eventually(lambda: knows_w0(second))
    finally:
        await client.close()
        await server.stop(0)


# ---------------------------------------------------------------- Redis


@contextlib.contextmanager
def redis_on(port: int, workdir: Path) -> Iterator[str]:
    """redis-server on `port` (nothing persisted: a restart loses the index)."""
    process = subprocess.Popen(
        [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)], cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for_redis(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=5)


async def test_redis_stopped_fails_lookups_fast_and_a_restart_is_resynced(tmp_path: Path) -> None:
    port = free_port()
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{port}/0", BLOCK, socket_timeout_s=0.3)
    service = KvIndexService(backend, MODEL_KEY)
    try:
        async with publishing(service.publish):
            with redis_on(port, tmp_path):
                await eventually(lambda: knows_w0(service))
            started = time.monotonic()
            with pytest.raises(redis.ConnectionError):
                await service.lookup_tokens(PROMPT)                # refused
            with pytest.raises(RedisPaused):
                await service.lookup_tokens(PROMPT)                # not even tried
            assert time.monotonic() - started < 1.0
            with redis_on(port, tmp_path):                         # back, and empty
                await eventually(lambda: knows_w0(service))
    finally:
        await service.close()


@contextlib.asynccontextmanager
async def black_hole() -> AsyncIterator[int]:
    """A TCP listener on 127.0.0.1 that accepts connections and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def swallow(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_black_holed_redis_times_out_then_fails_at_once() -> None:
    async with black_hole() as port:
        backend = RedisBackend.from_url(f"redis://127.0.0.1:{port}/0", BLOCK, socket_timeout_s=0.2)
        query = LookupQuery(prompt_hashes(PROMPT, BLOCK, MODEL_KEY).block_hashes)
        try:
            started = time.monotonic()
            with pytest.raises((redis.TimeoutError, redis.ConnectionError)):
                await backend.lookup(query)
            assert time.monotonic() - started < 1.0
            started = time.monotonic()
            for _ in range(5):
                with pytest.raises(RedisPaused):
                    await backend.publish(PublishBatch("w0", full_resync=True, snapshot=(chain(),)))
            assert time.monotonic() - started < 0.1
        finally:
            await backend.close()


async def test_the_scheduler_routes_without_a_black_holed_index() -> None:
    async with black_hole() as port:
        backend = RedisBackend.from_url(f"redis://127.0.0.1:{port}/0", BLOCK, socket_timeout_s=0.1)
        server = build_server(KvIndexService(backend, MODEL_KEY), "127.0.0.1", 0)
        await server.start()
        heard: list[bool] = []
        router = KvIndexRouter(f"127.0.0.1:{server.port}", time.monotonic, on_availability=heard.append)
        try:
            started = time.monotonic()
            for _ in range(6):
                assert await router.cached_prefix_tokens(PROMPT) == {}
            assert time.monotonic() - started < 1.5
            assert heard == [False] and not router.available
        finally:
            await router.close()
            await server.stop(0)
            await backend.close()


def test_the_socket_timeout_setting() -> None:
    assert KvCacheSettings.from_env({}).redis_socket_timeout_s == 0.5
    assert KvCacheSettings.from_env({"REDIS_SOCKET_TIMEOUT_S": "0.2"}).redis_socket_timeout_s == 0.2
    with pytest.raises(SettingsError, match="REDIS_SOCKET_TIMEOUT_S"):
        KvCacheSettings.from_env({"REDIS_SOCKET_TIMEOUT_S": "0"})
