"""Prometheus metrics of the kvcache service (fairserve_kvcache_*)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.metrics import LATENCY_BUCKETS_S, metric_name
from services.kvcache.kv_types import (
    AllCleared, BlockRemoved, BlockStored, IndexStats, PublishBatch, PublishResult,
)

SERVICE = "kvcache"
_EVENT_KINDS = {BlockStored: "stored", BlockRemoved: "removed", AllCleared: "cleared"}


class KvCacheMetrics:
    """Counters are per replica; the gauges mirror the (possibly shared)
    index and are refreshed from its stats."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.lookups = Counter(metric_name(SERVICE, "lookups_total"), "Lookups served", registry=r)
        self.lookup_hits = Counter(metric_name(SERVICE, "lookup_hits_total"),
                                   "Lookups where some worker holds a prefix", registry=r)
        self.lookup_tokens = Counter(metric_name(SERVICE, "lookup_tokens_total"),
                                     "Prompt tokens looked up", registry=r)
        self.hit_tokens = Counter(metric_name(SERVICE, "lookup_hit_tokens_total"),
                                  "Prompt tokens found cached on the best worker", registry=r)
        self.lookup_seconds = Histogram(metric_name(SERVICE, "lookup_seconds"), "Lookup latency",
                                        buckets=LATENCY_BUCKETS_S, registry=r)
        self.events = Counter(metric_name(SERVICE, "events_total"),
                              "Block events received, by kind", ["kind"], registry=r)
        self.resyncs = Counter(metric_name(SERVICE, "resyncs_total"),
                               "Full resyncs received", registry=r)
        self.resync_requests = Counter(metric_name(SERVICE, "resync_requests_total"),
                                       "Publish answers asking a worker to resync", registry=r)
        self.nodes = Gauge(metric_name(SERVICE, "index_nodes"), "Nodes in the index", registry=r)
        self.blocks = Gauge(metric_name(SERVICE, "index_blocks"),
                            "Blocks indexed, by worker", ["worker"], registry=r)

    def observe_lookup(self, query_tokens: int, best_tokens: int, seconds: float) -> None:
        self.lookups.inc()
        self.lookup_tokens.inc(query_tokens)
        self.lookup_seconds.observe(seconds)
        if best_tokens > 0:
            self.lookup_hits.inc()
            self.hit_tokens.inc(best_tokens)

    def observe_publish(self, batch: PublishBatch, result: PublishResult) -> None:
        if batch.full_resync:
            self.resyncs.inc()
        for event in batch.events:
            self.events.labels(kind=_EVENT_KINDS[type(event.body)]).inc()
        if result.resync_needed:
            self.resync_requests.inc()

    def refresh(self, stats: IndexStats) -> None:
        self.nodes.set(stats.nodes)
        self.blocks.clear()
        for worker, count in stats.blocks_by_worker.items():
            self.blocks.labels(worker=worker).set(count)
