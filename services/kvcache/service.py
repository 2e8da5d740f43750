"""The kvcache service's behaviour, independent of gRPC: lookups by tokens
or hashes, publishing with validation, stats, metrics. A lookup by tokens
hashes them under the requester's cache salt, as the worker hashed the
blocks of that salt's sequences, so it never matches another salt's blocks."""

from __future__ import annotations

from collections.abc import Sequence

from common.block_hash import prompt_hashes, salted_key
from services.kvcache.stores.backend import IndexBackend
from services.kvcache.kv_types import (
    IndexStats, LookupQuery, LookupResult, PublishBatch, PublishResult, RecordedLookup,
)
from services.kvcache.metrics import KvCacheMetrics
from services.kvcache.rules import validate_chain, validate_event


class KvIndexService:
    def __init__(self, backend: IndexBackend, model_key: str = "",
                 metrics: KvCacheMetrics | None = None) -> None:
        self.backend = backend
        self.model_key = model_key
        self.metrics = metrics if metrics is not None else KvCacheMetrics()

    @property
    def block_size(self) -> int:
        return self.backend.block_size

    def query_for_tokens(self, token_ids: Sequence[int], cache_salt: str = "") -> LookupQuery:
        hashes = prompt_hashes(token_ids, self.block_size, salted_key(self.model_key, cache_salt))
        return LookupQuery(hashes.block_hashes, hashes.partial_hash, hashes.partial_tokens)

    async def lookup_tokens(self, token_ids: Sequence[int], cache_salt: str = "") -> LookupResult:
        return await self.lookup(self.query_for_tokens(token_ids, cache_salt))

    async def lookup(self, query: LookupQuery) -> LookupResult:
        if query.partial_tokens < 0 or query.partial_tokens >= self.block_size:
            raise ValueError(f"partial_tokens must be in [0, {self.block_size})")
        if (query.partial_hash == 0) != (query.partial_tokens == 0):
            raise ValueError("partial_hash and partial_tokens go together")
        matches = await self.backend.lookup(query)
        best = matches[0].matched_tokens if matches else 0
        self.metrics.observe_lookup(query.num_tokens(self.block_size), best)
        return LookupResult(tuple(matches), self.block_size)

    async def record_lookups(self, lookups: Sequence[RecordedLookup]) -> None:
        """Counts lookups that were not asked (one worker) as a lookup of the prompt that
        matched what its worker reused; ValueError (nothing counted) for an impossible one."""
        for lookup in lookups:
            lookup.check()
        await self.backend.record_lookups(lookups)
        for lookup in lookups:
            self.metrics.observe_lookup(lookup.prompt_tokens, lookup.cached_tokens)

    async def publish(self, batch: PublishBatch) -> PublishResult:
        if not batch.worker_id:
            raise ValueError("worker_id is required")
        if batch.full_resync:
            for chain in batch.snapshot:
                validate_chain(chain)
        else:
            for event in batch.events:
                validate_event(event.body)
        result = await self.backend.publish(batch)
        self.metrics.observe_publish(batch, result)
        return result

    async def stats(self) -> IndexStats:
        stats = await self.backend.stats()
        self.metrics.refresh(stats)
        return stats

    async def close(self) -> None:
        await self.backend.close()
