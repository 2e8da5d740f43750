"""Behaviour every backend must share (memory and a real Redis), plus what
only Redis gives: surviving a restart and sharing one index."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from common.block_hash import chain_hashes
from services.kvcache.stores.backend import IndexBackend, MemoryBackend
from services.kvcache.kv_types import (
    AllCleared, BlockRemoved, BlockStored, KvEvent, LookupQuery, PublishBatch, PublishResult,
    RecordedLookup, WorkerMatch,
)
from services.kvcache.stores.redis_backend import RedisBackend
from services.kvcache.service import KvIndexService

BLOCK = 4


def hashes(*tokens: int) -> tuple[int, ...]:
    return tuple(chain_hashes(list(tokens), BLOCK))


def stored(parent: int, blocks: tuple[int, ...], partial: int = 0) -> BlockStored:
    return BlockStored(parent, blocks, partial)


def events(start_seq: int, *bodies: object) -> tuple[KvEvent, ...]:
    return tuple(KvEvent(start_seq + i, body) for i, body in enumerate(bodies))  # type: ignore[arg-type]


async def join(backend: IndexBackend, worker: str, seq: int = 0) -> None:
    """A worker starting over: an empty full resync."""
    assert await backend.publish(PublishBatch(worker, full_resync=True, snapshot_seq=seq)) == \
        PublishResult(False, seq + 1)


PROMPT = list(range(100, 100 + 3 * BLOCK))  # three full blocks
P = hashes(*PROMPT)


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[IndexBackend]:
    if request.param == "memory":
        instance: IndexBackend = MemoryBackend(BLOCK)
    else:
        instance = RedisBackend.from_url(request.getfixturevalue("redis_url"), BLOCK)
    yield instance
    await instance.close()


async def test_unknown_worker_must_resync_first(backend: IndexBackend) -> None:
    result = await backend.publish(PublishBatch("w", events(1, stored(0, P))))
    assert result == PublishResult(True, 1)
    assert await backend.lookup(LookupQuery(P)) == []


async def test_events_in_order_are_applied(backend: IndexBackend) -> None:
    await join(backend, "w")
    result = await backend.publish(PublishBatch("w", events(1, stored(0, P[:2]), stored(P[1], P[2:]))))
    assert result == PublishResult(False, 3)
    assert await backend.lookup(LookupQuery(P)) == [WorkerMatch("w", 3, 3 * BLOCK, True)]
    stats = await backend.stats()
    assert stats.events == 2 and stats.blocks_by_worker == {"w": 3}
    assert stats.backend == backend.name


async def test_gap_asks_for_resync_and_resync_replaces(backend: IndexBackend) -> None:
    await join(backend, "w")
    await backend.publish(PublishBatch("w", events(1, stored(0, P))))
    gap = await backend.publish(PublishBatch("w", events(3, BlockRemoved(P))))
    assert gap == PublishResult(True, 2)
    assert (await backend.lookup(LookupQuery(P)))[0].matched_blocks == 3  # nothing applied
    # Later batches keep failing until the resync: the index never skips a hole.
    assert (await backend.publish(PublishBatch("w", events(4, AllCleared())))).resync_needed
    other = hashes(7, 7, 7, 7)
    result = await backend.publish(PublishBatch("w", full_resync=True,
                                                 snapshot=(stored(0, other),), snapshot_seq=9))
    assert result == PublishResult(False, 10)
    assert await backend.lookup(LookupQuery(P)) == []
    assert await backend.lookup(LookupQuery(other)) == [WorkerMatch("w", 1, BLOCK, True)]
    assert (await backend.publish(PublishBatch("w", events(10, BlockRemoved(other))))) == \
        PublishResult(False, 11)
    stats = await backend.stats()
    assert stats.resyncs == 2 and stats.blocks_by_worker == {"w": 0}


async def test_duplicates_are_skipped(backend: IndexBackend) -> None:
    await join(backend, "w")
    batch = events(1, stored(0, P[:1]), stored(P[0], P[1:]))
    await backend.publish(PublishBatch("w", batch))
    await backend.publish(PublishBatch("w", events(3, BlockRemoved(P[2:]))))
    # A retransmission of 1..3 plus the new 4: only 4 is applied.
    again = await backend.publish(PublishBatch("w", batch + events(3, BlockRemoved(P[2:]),
                                                                    BlockRemoved(P[1:2]))))
    assert again == PublishResult(False, 5)
    assert (await backend.lookup(LookupQuery(P)))[0].matched_blocks == 1


async def test_inconsistent_store_asks_for_resync(backend: IndexBackend) -> None:
    await join(backend, "a")
    await join(backend, "b")
    await backend.publish(PublishBatch("a", events(1, stored(0, P[:2]))))
    result = await backend.publish(PublishBatch("b", events(1, stored(P[1], P[2:]))))
    assert result == PublishResult(True, 1)
    assert await backend.lookup(LookupQuery(P)) == [WorkerMatch("a", 2, 2 * BLOCK, False)]


async def test_longest_prefix_per_worker_longest_first(backend: IndexBackend) -> None:
    for worker in ("a", "b", "c"):
        await join(backend, worker)
    await backend.publish(PublishBatch("a", events(1, stored(0, P[:1]))))
    await backend.publish(PublishBatch("b", events(1, stored(0, P))))
    await backend.publish(PublishBatch("c", events(1, stored(0, P[:2]))))
    matches = await backend.lookup(LookupQuery(P + hashes(*PROMPT, 1, 2, 3, 4)[3:]))
    assert matches == [WorkerMatch("b", 3, 3 * BLOCK, False), WorkerMatch("c", 2, 2 * BLOCK, False),
                       WorkerMatch("a", 1, BLOCK, False)]


async def test_exact_match_needs_the_partial_block(backend: IndexBackend) -> None:
    await join(backend, "a")
    await join(backend, "b")
    await backend.publish(PublishBatch("a", events(1, stored(0, P[:2], partial=555))))
    await backend.publish(PublishBatch("b", events(1, stored(0, P[:2], partial=666))))
    query = LookupQuery(P[:2], partial_hash=555, partial_tokens=3)
    assert await backend.lookup(query) == [WorkerMatch("a", 2, 2 * BLOCK + 3, True),
                                           WorkerMatch("b", 2, 2 * BLOCK, False)]
    await backend.publish(PublishBatch("a", events(2, BlockRemoved((555,)))))
    assert (await backend.lookup(query))[0] == WorkerMatch("a", 2, 2 * BLOCK, False)


async def test_exact_match_of_a_prompt_shorter_than_a_block(backend: IndexBackend) -> None:
    await join(backend, "a")
    await backend.publish(PublishBatch("a", events(1, stored(0, (), partial=777))))
    assert await backend.lookup(LookupQuery((), 777, 2)) == [WorkerMatch("a", 0, 2, True)]
    assert await backend.lookup(LookupQuery((), 778, 2)) == []


async def test_cleared_forgets_the_worker_blocks(backend: IndexBackend) -> None:
    await join(backend, "a")
    await join(backend, "b")
    await backend.publish(PublishBatch("a", events(1, stored(0, P, partial=5))))
    await backend.publish(PublishBatch("b", events(1, stored(0, P[:1]))))
    await backend.publish(PublishBatch("a", events(2, AllCleared())))
    assert await backend.lookup(LookupQuery(P, 5, 1)) == [WorkerMatch("b", 1, BLOCK, False)]
    assert (await backend.stats()).blocks_by_worker == {"a": 0, "b": 1}


async def test_lookup_stats(backend: IndexBackend) -> None:
    await join(backend, "a")
    await backend.publish(PublishBatch("a", events(1, stored(0, P[:2]))))
    await backend.lookup(LookupQuery(P))                                  # hit, 8 of 12
    await backend.lookup(LookupQuery(hashes(1, 1, 1, 1), 9, 2))           # miss, 6 tokens
    stats = await backend.stats()
    assert (stats.lookups, stats.hits, stats.lookup_tokens, stats.hit_tokens) == (2, 1, 18, 8)
    assert stats.nodes >= 1


async def test_random_churn_agrees_with_the_memory_backend(redis_url: str) -> None:
    """Differential test: the Lua implementation against the Python one."""
    redis_backend = RedisBackend.from_url(redis_url, BLOCK)
    memory = MemoryBackend(BLOCK)
    rng = random.Random(7)
    paths = [[rng.randrange(3) for _ in range(rng.randrange(1, 7) * BLOCK)] for _ in range(12)]
    seqs = {"w0": 0, "w1": 0}
    try:
        for worker in seqs:
            for backend in (memory, redis_backend):
                await join(backend, worker)
        for _ in range(150):
            worker = rng.choice(list(seqs))
            path = hashes(*rng.choice(paths))
            roll = rng.random()
            if roll < 0.5:
                start = rng.randrange(len(path))
                body: object = stored(path[start - 1] if start else 0, path[start:],
                                      rng.choice([0, 0, rng.randrange(1, 50)]))
            elif roll < 0.85:
                body = BlockRemoved(tuple(rng.sample(path, rng.randrange(1, len(path) + 1))))
            elif roll < 0.9:
                body = AllCleared()
            else:
                snapshot = tuple(stored(0, hashes(*rng.choice(paths))) for _ in range(2))
                batch = PublishBatch(worker, full_resync=True, snapshot=snapshot,
                                     snapshot_seq=seqs[worker])
                assert await memory.publish(batch) == await redis_backend.publish(batch)
                continue
            seqs[worker] += 1
            batch = PublishBatch(worker, events(seqs[worker], body))
            result = await memory.publish(batch)
            assert await redis_backend.publish(batch) == result
            if result.resync_needed:
                seqs[worker] = result.next_seq - 1
            for probe in paths:
                query = LookupQuery(hashes(*probe), rng.randrange(1, 50), 2)
                assert await redis_backend.lookup(query) == await memory.lookup(query)
        memory_stats, redis_stats = await memory.stats(), await redis_backend.stats()
        assert memory_stats.blocks_by_worker == redis_stats.blocks_by_worker
        assert (memory_stats.events, memory_stats.resyncs) == (redis_stats.events, redis_stats.resyncs)
        held = set().union(*(memory.index.blocks_of(worker) for worker in seqs))
        assert redis_stats.nodes == len(held)  # Redis keeps one key per held block
    finally:
        await redis_backend.close()


async def test_redis_index_survives_a_restart(redis_url: str) -> None:
    first = KvIndexService(RedisBackend.from_url(redis_url, BLOCK))
    await join(first.backend, "w")
    await first.publish(PublishBatch("w", events(1, stored(0, P))))
    await first.close()

    second = KvIndexService(RedisBackend.from_url(redis_url, BLOCK))
    try:
        result = await second.lookup(LookupQuery(P))
        assert result.matches == (WorkerMatch("w", 3, 3 * BLOCK, True),)
        # The worker's sequence numbers carry on without a resync.
        assert await second.publish(PublishBatch("w", events(2, BlockRemoved(P[2:])))) == \
            PublishResult(False, 3)
    finally:
        await second.close()


async def test_two_replicas_share_one_index(redis_url: str) -> None:
    one = RedisBackend.from_url(redis_url, BLOCK)
    two = RedisBackend.from_url(redis_url, BLOCK)
    try:
        await join(one, "w")
        await one.publish(PublishBatch("w", events(1, stored(0, P[:2]))))
        assert await two.publish(PublishBatch("w", events(2, stored(P[1], P[2:])))) == \
            PublishResult(False, 3)
        assert (await one.lookup(LookupQuery(P)))[0].matched_blocks == 3
        assert (await two.lookup(LookupQuery(P)))[0].matched_blocks == 3
        # A gap is a gap whichever replica sees it.
        assert (await one.publish(PublishBatch("w", events(5, AllCleared())))).resync_needed
        assert (await two.stats()).lookups == 2
    finally:
        await one.close()
        await two.close()


async def test_recorded_lookups_count_as_lookups_do(backend: IndexBackend) -> None:
    """Lookups not asked (one worker) counted after the fact: a lookup each, a hit where the
    worker reused something, their tokens, as a lookup's own counts."""
    before = await backend.stats()
    await backend.record_lookups([RecordedLookup(1496, 1486, "r1"), RecordedLookup(40, 0, "r2")])
    await backend.record_lookups([])
    after = await backend.stats()
    assert (after.lookups - before.lookups, after.hits - before.hits) == (2, 1)
    assert (after.lookup_tokens - before.lookup_tokens, after.hit_tokens - before.hit_tokens) == (1536, 1486)


async def test_an_impossible_recorded_lookup_counts_nothing() -> None:
    service = KvIndexService(MemoryBackend(BLOCK))
    for bad in (RecordedLookup(10, 11), RecordedLookup(10, -1)):
        with pytest.raises(ValueError, match="cached_tokens"):
            await service.record_lookups([RecordedLookup(10, 5), bad])
    assert (await service.stats()).lookups == 0
    await service.record_lookups([RecordedLookup(10, 5)])
    stats = await service.stats()
    assert (stats.lookups, stats.hit_tokens) == (1, 5) and service.metrics.hit_rate() == 0.5
