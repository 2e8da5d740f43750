"""The interface every index backend implements, and the in-memory one."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from services.kvcache.kv_types import (
    IndexStats, LookupQuery, PublishBatch, PublishResult, RecordedLookup, WorkerMatch,
)
from services.kvcache.radix_index import InconsistentEvent, RadixIndex
from services.kvcache.rules import combine_matches, plan_events

log = logging.getLogger(__name__)


class IndexBackend(Protocol):
    name: str
    block_size: int

    async def publish(self, batch: PublishBatch) -> PublishResult: ...

    async def lookup(self, query: LookupQuery) -> list[WorkerMatch]: ...

    async def record_lookups(self, lookups: Sequence[RecordedLookup]) -> None: ...

    async def stats(self) -> IndexStats: ...

    async def close(self) -> None: ...


class MemoryBackend:
    """The radix tree in this process: fastest, lost on restart, not shared."""

    name = "memory"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.index = RadixIndex()
        self._last_seq: dict[str, int] = {}
        self._lookups = 0
        self._hits = 0
        self._lookup_tokens = 0
        self._hit_tokens = 0
        self._events = 0
        self._resyncs = 0

    async def publish(self, batch: PublishBatch) -> PublishResult:
        worker = batch.worker_id
        if batch.full_resync:
            dropped = self.index.replace_worker(worker, batch.snapshot)
            if dropped:
                log.warning("resync dropped unreachable chains",
                            extra={"worker_id": worker, "dropped": dropped})
            self._last_seq[worker] = batch.snapshot_seq
            self._resyncs += 1
            return PublishResult(False, batch.snapshot_seq + 1)
        last = self._last_seq.get(worker)
        plan = plan_events(last, batch.events)
        for event in plan.apply:
            try:
                self.index.apply(worker, event.body)
            except InconsistentEvent as error:
                log.warning("inconsistent event, asking for a resync",
                            extra={"worker_id": worker, "seq": event.seq, "error": str(error)})
                return PublishResult(True, event.seq)
            self._last_seq[worker] = event.seq
            self._events += 1
        return PublishResult(plan.gap, self._last_seq.get(worker, 0) + 1)

    async def lookup(self, query: LookupQuery) -> list[WorkerMatch]:
        prefix = self.index.match_prefix(query.block_hashes)
        holders = self.index.partial_holders(query.partial_hash) if query.partial_hash else ()
        matches = combine_matches(prefix, holders, query, self.block_size)
        self._count(query.num_tokens(self.block_size), matches[0].matched_tokens if matches else 0)
        return matches

    async def record_lookups(self, lookups: Sequence[RecordedLookup]) -> None:
        for lookup in lookups:
            self._count(lookup.prompt_tokens, lookup.cached_tokens)

    def _count(self, tokens: int, matched: int) -> None:
        self._lookups += 1
        self._lookup_tokens += tokens
        if matched > 0:
            self._hits += 1
            self._hit_tokens += matched

    async def stats(self) -> IndexStats:
        blocks = {worker: 0 for worker in self._last_seq}
        blocks.update(self.index.blocks_by_worker())
        return IndexStats(
            lookups=self._lookups, hits=self._hits, lookup_tokens=self._lookup_tokens,
            hit_tokens=self._hit_tokens, nodes=self.index.num_nodes, events=self._events,
            resyncs=self._resyncs, blocks_by_worker=blocks, backend=self.name,
        )

    async def close(self) -> None:
        return None
