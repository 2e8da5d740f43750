"""The engine's KV block events, through the worker's publisher, into an in-process
index: a whole prompt's partial last block is published under the prompt's partial
hash, so that a lookup by the prompt's tokens sees the worker's exact match."""

from __future__ import annotations

import asyncio
import random

from common.block_hash import prompt_hashes
from services.kvcache.stores.backend import MemoryBackend
from services.kvcache.kv_types import LookupQuery, WorkerMatch
from services.kvcache.publisher import KvEventPublisher
from services.worker.engine.engine import Engine
from common.step import StepBatch
from services.worker.engine.types import REMOVED, STORED, BlockEvent
from services.worker.kv_events import add_events, snapshot_source
from tests.unit.worker.engine_helpers import Driver, make_engine, prompt_of

KIND = "llama"
BLOCK_SIZE = 4
WORKER = "w"


class Published:
    """An engine whose events go to a memory index through the worker's publisher."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.backend = MemoryBackend(BLOCK_SIZE)

        async def cache() -> tuple[list[tuple[int, list[int]]], list[tuple[int, int]]]:
            return engine.snapshot_chains(), engine.snapshot_partials()

        self.publisher = KvEventPublisher(WORKER, self.backend.publish, snapshot_source(cache))

    async def sync(self) -> list[BlockEvent]:
        """Drains the engine's events, publishes them and returns them."""
        events = self.engine.drain_events()
        add_events(self.publisher, events)
        assert await self.publisher.flush()
        return events

    async def lookup(self, prompt: list[int]) -> WorkerMatch | None:
        hashes = prompt_hashes(prompt, BLOCK_SIZE, KIND)
        query = LookupQuery(hashes.block_hashes, hashes.partial_hash, hashes.partial_tokens)
        return next((m for m in await self.backend.lookup(query) if m.worker_id == WORKER), None)

    def assert_agrees(self) -> None:
        """The index holds for the worker exactly what a full resync would send."""
        index = self.backend.index
        index.check_invariants()
        assert index.blocks_of(WORKER) == {
            value for _parent, chain in self.engine.snapshot_chains() for value in chain}
        assert index.partials_of(WORKER) == {alias for _parent, alias in self.engine.snapshot_partials()}


def _partial_stores(events: list[BlockEvent]) -> list[BlockEvent]:
    return [event for event in events if event.kind == STORED and event.partial_hash]


def test_prompt_ending_in_a_partial_block_is_published_and_matched_exactly() -> None:
    async def scenario() -> None:
        published = Published(make_engine(KIND, block_size=BLOCK_SIZE))
        await published.sync()                      # the first flush is a (empty) resync
        prompt = prompt_of(15, 1)
        Driver(published.engine).run({"a": prompt}, max_new_tokens=1)
        events = await published.sync()
        hashes = prompt_hashes(prompt, BLOCK_SIZE, KIND)
        assert hashes.partial_hash and len(hashes.block_hashes) == 3
        assert _partial_stores(events) == [
            BlockEvent.stored([], hashes.block_hashes[-1], partial_hash=hashes.partial_hash)]
        assert published.engine.snapshot_partials() == [(hashes.block_hashes[-1], hashes.partial_hash)]
        match = await published.lookup(prompt)
        assert match is not None and match.exact and match.matched_tokens == 15
        # Same full blocks, another tail: not exact, only the full blocks match.
        other = prompt[:12] + [token + 1 for token in prompt[12:]]
        match = await published.lookup(other)
        assert match is not None and not match.exact and match.matched_tokens == 12
        published.assert_agrees()
    asyncio.run(scenario())


def test_generated_tokens_in_the_partial_block_keep_the_prompts_alias() -> None:
    async def scenario() -> None:
        published = Published(make_engine(KIND, block_size=BLOCK_SIZE))
        await published.sync()
        prompt = prompt_of(14, 2)
        # 14 prompt tokens and 1 generated one computed: the kept block holds 3 tokens.
        Driver(published.engine).run({"a": prompt}, max_new_tokens=2)
        events = await published.sync()
        hashes = prompt_hashes(prompt, BLOCK_SIZE, KIND)
        assert [event.partial_hash for event in _partial_stores(events)] == [hashes.partial_hash]
        match = await published.lookup(prompt)
        assert match is not None and match.exact and match.matched_tokens == 14
        published.assert_agrees()
    asyncio.run(scenario())


def test_block_aligned_prompt_or_prompt_ending_in_a_full_block_publishes_no_alias() -> None:
    async def scenario() -> None:
        published = Published(make_engine(KIND, block_size=BLOCK_SIZE))
        await published.sync()
        aligned, overflowed = prompt_of(16, 3), prompt_of(13, 4)
        driver = Driver(published.engine)
        driver.run({"aligned": aligned}, max_new_tokens=1)
        # 13 prompt tokens + 4 generated computed: the prompt ends inside a full block.
        driver.run({"overflowed": overflowed}, max_new_tokens=5)
        events = await published.sync()
        assert _partial_stores(events) == []
        assert published.engine.snapshot_partials() == []
        match = await published.lookup(aligned)
        assert match is not None and match.exact and match.matched_tokens == 16
        match = await published.lookup(overflowed)
        assert match is not None and not match.exact and match.matched_tokens == 12
        published.assert_agrees()
    asyncio.run(scenario())


def test_evicting_the_partial_block_removes_its_alias() -> None:
    async def scenario() -> None:
        published = Published(make_engine(KIND, num_blocks=8, block_size=BLOCK_SIZE))
        await published.sync()
        prompt = prompt_of(15, 5)
        driver = Driver(published.engine)
        driver.run({"a": prompt}, max_new_tokens=1)
        await published.sync()
        alias = prompt_hashes(prompt, BLOCK_SIZE, KIND).partial_hash
        assert published.backend.index.partials_of(WORKER) == {alias}
        # A 30-token filler needs all 8 blocks: everything cached is evicted.
        filler = prompt_of(30, 6)
        driver.run({"filler": filler}, max_new_tokens=1)
        events = await published.sync()
        removed = [value for event in events if event.kind == REMOVED for value in event.hashes]
        assert removed.count(alias) == 1
        # The filler's own partial block is what remains published.
        filler_alias = prompt_hashes(filler, BLOCK_SIZE, KIND).partial_hash
        assert [alias for _parent, alias in published.engine.snapshot_partials()] == [filler_alias]
        assert published.backend.index.partials_of(WORKER) == {filler_alias}
        assert await published.lookup(prompt) is None
        published.assert_agrees()
    asyncio.run(scenario())


def test_resync_snapshot_carries_the_aliases() -> None:
    async def scenario() -> None:
        published = Published(make_engine(KIND, block_size=BLOCK_SIZE))
        await published.sync()
        prompts = {"short": prompt_of(3, 7), "long": prompt_of(10, 8)}
        Driver(published.engine).run(prompts, max_new_tokens=1)
        published.engine.drain_events()             # lost: only the snapshot tells the index
        published.publisher.request_resync()
        await published.sync()
        assert published.publisher.resyncs_sent == 2
        published.assert_agrees()
        assert len(published.backend.index.partials_of(WORKER)) == 2
        for prompt in prompts.values():
            match = await published.lookup(prompt)
            assert match is not None and match.exact and match.matched_tokens == len(prompt)
    asyncio.run(scenario())


def test_index_agrees_with_the_engine_through_churn_and_evictions() -> None:
    async def scenario() -> None:
        published = Published(make_engine(KIND, num_blocks=16, block_size=BLOCK_SIZE))
        await published.sync()
        rng = random.Random(7)
        shared = [prompt_of(rng.randrange(2, 14), 20 + n) for n in range(3)]
        driver = Driver(published.engine)
        sent: list[list[int]] = []
        for round_index in range(16):
            group = {}
            for member in range(2):
                prompt = rng.choice(shared) + [rng.randrange(10, 380) for _ in range(rng.randrange(1, 10))]
                if rng.random() < 0.3 and sent:
                    prompt = list(rng.choice(sent))    # the same prompt again
                group[f"r{round_index}-{member}"] = prompt
                sent.append(prompt)
            driver.run(group, max_new_tokens=rng.choice([1, 1, 2, 3]))
            await published.sync()
            published.assert_agrees()
            # Every published alias is a sent prompt's, and looking that prompt up is exact.
            aliases = {alias for _parent, alias in published.engine.snapshot_partials()}
            for prompt in sent:
                hashes = prompt_hashes(prompt, BLOCK_SIZE, KIND)
                if hashes.partial_hash in aliases:
                    aliases.discard(hashes.partial_hash)
                    match = await published.lookup(prompt)
                    assert match is not None and match.exact and match.matched_tokens == len(prompt)
            assert not aliases
        assert published.engine.pool_stats().evictions > 0, "the churn must evict"
        assert published.publisher.resyncs_sent == 1, "no event may contradict the index"
        driver.step(StepBatch())
        published.engine.pool.clear_cache()
        await published.sync()
        published.assert_agrees()
        assert published.backend.index.partials_of(WORKER) == frozenset()
    asyncio.run(scenario())
