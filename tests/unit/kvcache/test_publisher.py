from __future__ import annotations

import asyncio
import logging

import pytest

from common.block_hash import chain_hashes
from services.kvcache.stores.backend import MemoryBackend
from services.kvcache.kv_types import BlockStored, PublishBatch, PublishResult
from services.kvcache.publisher import KvEventPublisher


class FakeWorkerCache:
    """What a worker's block pool holds: block hash -> parent hash."""

    def __init__(self) -> None:
        self.parents: dict[int, int] = {}

    def store(self, publisher: KvEventPublisher, tokens: list[int], start_block: int = 0) -> list[int]:
        blocks = chain_hashes(tokens, 1)
        parent = blocks[start_block - 1] if start_block else 0
        for previous, block in zip([parent, *blocks[start_block:]], blocks[start_block:]):
            self.parents[block] = previous
        publisher.stored(parent, blocks[start_block:])
        return blocks

    def store_only(self, tokens: list[int]) -> list[int]:
        """Fills the cache without publishing (state from before the publisher)."""
        blocks = chain_hashes(tokens, 1)
        for previous, block in zip([0, *blocks], blocks):
            self.parents[block] = previous
        return blocks

    def evict(self, publisher: KvEventPublisher, blocks: list[int]) -> None:
        for block in blocks:
            del self.parents[block]
        publisher.removed(blocks)

    def snapshot(self) -> list[BlockStored]:
        return [BlockStored(parent, (block,)) for block, parent in self.parents.items()]


class RecordingTransport:
    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend
        self.batches: list[PublishBatch] = []
        self.fail_next = 0

    async def send(self, batch: PublishBatch) -> PublishResult:
        self.batches.append(batch)
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("index unreachable")
        return await self.backend.publish(batch)


@pytest.fixture
def cache() -> FakeWorkerCache:
    return FakeWorkerCache()


@pytest.fixture
def transport() -> RecordingTransport:
    return RecordingTransport(MemoryBackend(1))


def make_publisher(transport: RecordingTransport, cache: FakeWorkerCache,
                   **options: int) -> KvEventPublisher:
    return KvEventPublisher("w", transport.send, cache.snapshot, **options)


def indexed(transport: RecordingTransport) -> frozenset[int]:
    return transport.backend.index.blocks_of("w")


async def test_first_flush_is_a_full_resync_then_numbered_events(
        transport: RecordingTransport, cache: FakeWorkerCache) -> None:
    publisher = make_publisher(transport, cache)
    assert await publisher.flush()
    assert transport.batches[0] == PublishBatch("w", full_resync=True, snapshot_seq=0)
    blocks = cache.store(publisher, [1, 2, 3])
    cache.evict(publisher, blocks[2:])
    assert await publisher.flush()
    assert [e.seq for e in transport.batches[1].events] == [1, 2]
    assert indexed(transport) == set(blocks[:2])
    assert publisher.pending == 0 and publisher.next_seq == 3


async def test_events_before_the_first_flush_travel_in_the_snapshot(
        transport: RecordingTransport, cache: FakeWorkerCache) -> None:
    publisher = make_publisher(transport, cache)
    blocks = cache.store(publisher, [4, 5])
    assert await publisher.flush()
    assert len(transport.batches) == 1
    assert transport.batches[0].snapshot_seq == 1
    assert indexed(transport) == set(blocks)
    cache.store(publisher, [4, 5, 6], start_block=2)
    assert await publisher.flush()
    assert transport.batches[1].events[0].seq == 2


async def test_batches_are_capped(transport: RecordingTransport, cache: FakeWorkerCache) -> None:
    publisher = make_publisher(transport, cache, max_batch_events=2)
    await publisher.flush()
    for token in range(5):
        cache.store(publisher, [100 + token])
    assert await publisher.flush()
    assert [len(b.events) for b in transport.batches[1:]] == [2, 2, 1]
    assert len(indexed(transport)) == 5


async def test_transport_error_keeps_events_for_the_next_flush(
        transport: RecordingTransport, cache: FakeWorkerCache) -> None:
    publisher = make_publisher(transport, cache)
    await publisher.flush()
    blocks = cache.store(publisher, [1, 2])
    transport.fail_next = 1
    with pytest.raises(ConnectionError):
        await publisher.flush()
    assert publisher.pending == 1 and publisher.unacknowledged == 1
    cache.evict(publisher, blocks[1:])
    assert await publisher.flush()
    assert [e.seq for e in transport.batches[-1].events] == [1, 2]
    assert indexed(transport) == {blocks[0]}
    assert publisher.unacknowledged == 0


async def test_a_due_resync_counts_as_unacknowledged(transport: RecordingTransport,
                                                     cache: FakeWorkerCache) -> None:
    publisher = make_publisher(transport, cache)
    cache.store(publisher, [1, 2])
    assert publisher.unacknowledged == 1   # the first flush sends a snapshot, not events
    assert await publisher.flush()
    assert publisher.unacknowledged == 0
    publisher.request_resync()
    assert publisher.unacknowledged == 1


async def test_index_restart_triggers_a_resync_in_the_same_flush(
        transport: RecordingTransport, cache: FakeWorkerCache) -> None:
    publisher = make_publisher(transport, cache)
    await publisher.flush()
    blocks = cache.store(publisher, [1, 2, 3])
    await publisher.flush()
    transport.backend = MemoryBackend(1)  # the index lost everything
    more = cache.store(publisher, [9])
    assert await publisher.flush()
    assert transport.batches[-2].events and transport.batches[-1].full_resync
    assert transport.batches[-1].snapshot_seq == 2
    assert indexed(transport) == set(blocks) | set(more)
    assert publisher.resyncs_sent == 2


async def test_failed_snapshot_is_retried(transport: RecordingTransport,
                                          cache: FakeWorkerCache) -> None:
    publisher = make_publisher(transport, cache)
    transport.fail_next = 1
    with pytest.raises(ConnectionError):
        await publisher.flush()
    assert publisher.needs_resync
    cache.store(publisher, [1])
    assert await publisher.flush()
    assert transport.batches[-1].full_resync and transport.batches[-1].snapshot_seq == 1


async def test_backlog_overflow_falls_back_to_a_resync(transport: RecordingTransport,
                                                       cache: FakeWorkerCache) -> None:
    publisher = make_publisher(transport, cache, max_pending_events=3)
    await publisher.flush()
    for token in range(5):
        cache.store(publisher, [200 + token])
    assert publisher.needs_resync and publisher.pending == 0
    assert await publisher.flush()
    assert transport.batches[-1].full_resync and transport.batches[-1].snapshot_seq == 5
    assert len(indexed(transport)) == 5


async def test_events_during_a_resync_follow_it(cache: FakeWorkerCache) -> None:
    backend = MemoryBackend(1)
    publisher: KvEventPublisher
    added: list[int] = []

    async def slow_send(batch: PublishBatch) -> PublishResult:
        if batch.full_resync and not added:
            added.extend(cache.store(publisher, [7, 8]))
            await asyncio.sleep(0)
        return await backend.publish(batch)

    publisher = KvEventPublisher("w", slow_send, cache.snapshot)
    assert await publisher.flush()
    assert backend.index.blocks_of("w") == set(added)


async def test_gives_up_when_the_index_keeps_asking(cache: FakeWorkerCache) -> None:
    calls = 0

    async def always_resync(batch: PublishBatch) -> PublishResult:
        nonlocal calls
        calls += 1
        return PublishResult(True, 1)

    publisher = KvEventPublisher("w", always_resync, cache.snapshot, max_resyncs_per_flush=2)
    assert not await publisher.flush()
    assert calls == 2 and publisher.needs_resync


async def test_run_flushes_until_stopped_and_logs_failures_once(
        transport: RecordingTransport, cache: FakeWorkerCache,
        caplog: pytest.LogCaptureFixture) -> None:
    publisher = make_publisher(transport, cache)
    stop = asyncio.Event()
    transport.fail_next = 3
    with caplog.at_level(logging.WARNING, logger="services.kvcache.publisher"):
        task = asyncio.create_task(publisher.run(0.001, stop))
        blocks = cache.store(publisher, [1, 2])
        for _ in range(200):
            if indexed(transport) == set(blocks):
                break
            await asyncio.sleep(0.005)
        stop.set()
        await asyncio.wait_for(task, 2)
    assert indexed(transport) == set(blocks)
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1


def test_empty_events_are_not_numbered(transport: RecordingTransport,
                                       cache: FakeWorkerCache) -> None:
    publisher = make_publisher(transport, cache)
    publisher.stored(0, [])
    publisher.removed([])
    assert publisher.next_seq == 1
    publisher.cleared()
    assert publisher.next_seq == 2


async def test_async_snapshot_and_events_added_while_it_runs(cache: FakeWorkerCache) -> None:
    backend = MemoryBackend(1)
    publisher: KvEventPublisher
    before = cache.store_only([1, 2])
    during: list[int] = []

    async def snapshot() -> list[BlockStored]:
        chains = cache.snapshot()
        during.extend(cache.store(publisher, [1, 2, 3], start_block=2))
        await asyncio.sleep(0)
        return chains

    publisher = KvEventPublisher("w", backend.publish, snapshot)
    assert await publisher.flush()
    assert publisher.pending == 0
    assert backend.index.blocks_of("w") == set(before) | set(during)
