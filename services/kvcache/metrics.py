"""Prometheus metrics of the kvcache service, named as catalogued in
common.observability.prometheus_names (fairserve_kvcache_*)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from common.observability import prometheus_names as names
from services.kvcache.kv_types import IndexStats, PublishBatch, PublishResult


class KvCacheMetrics:
    """Counters and the hit rate are per replica; the index gauges mirror the
    (possibly shared) index and are refreshed from its stats."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.lookups = names.counter(names.KVCACHE_LOOKUPS, r)
        self.hits = names.counter(names.KVCACHE_HITS, r)
        self.lookup_tokens = names.counter(names.KVCACHE_LOOKUP_TOKENS, r)
        self.hit_tokens = names.counter(names.KVCACHE_HIT_TOKENS, r)
        self.events = names.counter(names.KVCACHE_EVENTS, r)
        self.resyncs = names.counter(names.KVCACHE_RESYNCS, r)
        self.nodes = names.gauge(names.KVCACHE_NODES, r)
        self.blocks = names.gauge(names.KVCACHE_BLOCKS, r)
        self._looked_up_tokens = 0
        self._found_tokens = 0
        names.gauge(names.KVCACHE_HIT_RATE, r).set_function(self.hit_rate)

    def hit_rate(self) -> float:
        return self._found_tokens / self._looked_up_tokens if self._looked_up_tokens else 0.0

    def observe_lookup(self, query_tokens: int, best_tokens: int) -> None:
        self.lookups.inc()
        self.lookup_tokens.inc(query_tokens)
        self._looked_up_tokens += query_tokens
        if best_tokens > 0:
            self.hits.inc()
            self.hit_tokens.inc(best_tokens)
            self._found_tokens += best_tokens

    def observe_publish(self, batch: PublishBatch, result: PublishResult) -> None:
        if batch.full_resync:
            self.resyncs.inc()
        self.events.inc(len(batch.events))

    def refresh(self, stats: IndexStats) -> None:
        self.nodes.set(stats.nodes)
        self.blocks.clear()
        for worker, count in stats.blocks_by_worker.items():
            self.blocks.labels(worker=worker).set(count)
