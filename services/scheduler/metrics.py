"""Prometheus metrics of the scheduler, named as catalogued in
common.observability.prometheus_names.

Queue lengths, totals, per-worker health and per-client counters are read
at scrape time from the latest stats snapshot, which the event loop
publishes; the scrape thread never touches the core. Step round trips and
queue waits are observed as they happen.

Per-client series are labelled by the fairness client id (a tenant name with
API keys, never a key). Clients are unbounded without API keys, so at most
MAX_CLIENT_LABELS of them get their own label (ClientLabels); the tokens
served to the rest add up under client="other".
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.observability import prometheus_names as names

from services.scheduler.core.routing import ROUTING_REASONS
from services.scheduler.core.types import CoreStats, FinishReason, Gate, ClientCounter

# Every label value is exported from the start, at 0, so rates work at once.
REJECTION_GATES = (Gate.QUEUE, Gate.QUOTA, Gate.NEVER_FIT, Gate.TIMEOUT, Gate.NO_WORKER, Gate.INVALID)
HOLD_GATES = (Gate.ACTIVE_KV, Gate.CACHE_POOL)
MAX_CLIENT_LABELS = 32
OTHER_CLIENTS = "other"


def _with_zeros(values: dict[str, int], keys: Iterable[str]) -> list[tuple[str, float]]:
    merged = {key: 0 for key in keys} | values
    return sorted(merged.items())


def _gauge(family: names.MetricFamily) -> GaugeMetricFamily:
    return GaugeMetricFamily(family.name, family.help, labels=list(family.labels))


def _counter(family: names.MetricFamily) -> CounterMetricFamily:
    return CounterMetricFamily(family.name, family.help, labels=list(family.labels))


def _by_label(family: names.MetricFamily, values: Iterable[tuple[str, float]],
              kind: type[GaugeMetricFamily] | type[CounterMetricFamily]) -> Metric:
    metric = _gauge(family) if kind is GaugeMetricFamily else _counter(family)
    for label, value in values:
        metric.add_metric([label], value)
    return metric


class ClientLabels:
    """Which clients get a label of their own in the per-client series.

    A client is labelled when the first scrape that sees it finds fewer than
    `limit` clients labelled (several new ones: the most served first), and
    keeps its label until the scheduler forgets it (idle, past its tracking
    bound), which frees the label. Every other client counts under "other"
    from then on, so no series ever moves between labels, and the "other"
    served-tokens counter only grows: a client leaving it (forgotten)
    leaves the tokens it had at the last scrape behind. A client named
    "other" always counts under "other".
    """

    def __init__(self, limit: int = MAX_CLIENT_LABELS) -> None:
        self._limit = limit
        self._labelled: set[str] = set()
        self._others: dict[str, int] = {}   # unlabelled client -> served tokens at the last scrape
        self._retired = 0                   # served tokens of unlabelled clients since forgotten
        self._lock = threading.Lock()

    def split(self, clients: Sequence[ClientCounter]) -> tuple[list[ClientCounter], int | None]:
        """The labelled clients, and the tokens served to all others (None
        while no client has gone unlabelled)."""
        with self._lock:
            present = {c.client_id: c for c in clients}
            self._labelled &= present.keys()
            for client_id, served in list(self._others.items()):
                now = present.get(client_id)
                if now is None or now.served_tokens < served:   # forgotten (and perhaps back)
                    self._retired += served
                    del self._others[client_id]
            new = [c for c in clients if c.client_id not in self._labelled and c.client_id not in self._others]
            for client in sorted(new, key=lambda c: (-c.served_tokens, c.client_id)):
                if len(self._labelled) < self._limit and client.client_id != OTHER_CLIENTS:
                    self._labelled.add(client.client_id)
                else:
                    self._others[client.client_id] = client.served_tokens
            for client_id in self._others:
                self._others[client_id] = present[client_id].served_tokens
            labelled = [c for c in clients if c.client_id in self._labelled]
            if not self._others and not self._retired:
                return labelled, None
            return labelled, self._retired + sum(self._others.values())


class _StatsCollector(Collector):
    def __init__(self, metrics: SchedulerMetrics) -> None:
        self._metrics = metrics
        self._client_labels = ClientLabels(metrics.max_client_labels)

    def collect(self) -> Iterator[Metric]:
        stats = self._metrics.snapshot
        if stats is None:
            return
        yield _by_label(names.SCHEDULER_REQUESTS, [("pending", stats.pending), ("prefilling", stats.prefilling),
                                                   ("active", stats.active)], GaugeMetricFamily)
        admitted = _counter(names.SCHEDULER_ADMITTED)
        admitted.add_metric([], stats.admitted)
        yield admitted
        preemptions = _counter(names.SCHEDULER_PREEMPTIONS)
        preemptions.add_metric([], stats.preemptions)
        yield preemptions
        migrations = _counter(names.SCHEDULER_MIGRATIONS)
        migrations.add_metric([], stats.migrations)
        yield migrations
        yield _by_label(names.SCHEDULER_FINISHED,
                        _with_zeros(stats.finished_by_reason, (r.value for r in FinishReason)), CounterMetricFamily)
        yield _by_label(names.SCHEDULER_REJECTIONS,
                        _with_zeros(stats.rejections, (g.value for g in REJECTION_GATES)), CounterMetricFamily)
        yield _by_label(names.SCHEDULER_ROUTED, _with_zeros(stats.routed, ROUTING_REASONS), CounterMetricFamily)
        yield _by_label(names.SCHEDULER_HOLDS,
                        _with_zeros(stats.holds, (g.value for g in HOLD_GATES)), CounterMetricFamily)
        reserved = _gauge(names.SCHEDULER_RESERVED_KV_TOKENS)
        reserved.add_metric([], stats.reserved_kv_tokens)
        yield reserved
        yield _by_label(names.SCHEDULER_WORKER_HEALTHY,
                        [(w.worker_id, 1.0 if w.healthy else 0.0) for w in stats.workers], GaugeMetricFamily)
        yield _by_label(names.SCHEDULER_WORKER_BATCH_SIZE,
                        [(w.worker_id, w.last_batch_size) for w in stats.workers], GaugeMetricFamily)
        yield from self._per_client(stats.clients)
        yield _by_label(names.SCHEDULER_POLICY, [(stats.policy.value, 1.0)], GaugeMetricFamily)

    def _per_client(self, clients: Sequence[ClientCounter]) -> Iterator[Metric]:
        """The VTC gauge of each labelled client (a counter has no meaning
        summed), and the tokens served to each and to "other"."""
        labelled, other_served = self._client_labels.split(clients)
        yield _by_label(names.SCHEDULER_CLIENT_VTC, [(c.client_id, c.counter) for c in labelled],
                        GaugeMetricFamily)
        served: list[tuple[str, float]] = [(c.client_id, c.served_tokens) for c in labelled]
        if other_served is not None:
            served.append((OTHER_CLIENTS, other_served))
        yield _by_label(names.SCHEDULER_CLIENT_SERVED_TOKENS, served, CounterMetricFamily)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None,
                 max_client_labels: int = MAX_CLIENT_LABELS) -> None:
        self.registry = registry or CollectorRegistry()
        self.snapshot: CoreStats | None = None
        self.max_client_labels = max_client_labels
        self.registry.register(_StatsCollector(self))
        step = names.SCHEDULER_WORKER_STEP
        self._step_seconds = Histogram(step.name, step.help, list(step.labels), buckets=step.buckets,
                                       registry=self.registry)
        wait = names.SCHEDULER_QUEUE_WAIT
        self._queue_wait = Histogram(wait.name, wait.help, buckets=wait.buckets, registry=self.registry)
        self._kv_index_up = names.gauge(names.SCHEDULER_KV_INDEX_UP, self.registry)
        self._kv_index_up.set(1)
        self._peers = names.gauge(names.SCHEDULER_PEERS, self.registry)
        self._peer_answers: dict[str, bool] = {}
        self._count_peers()

    def set_kv_index_up(self, up: bool) -> None:
        """Whether routing uses the KV index now (kv_router.KvIndexRouter)."""
        self._kv_index_up.set(1 if up else 0)

    def set_peer_up(self, peer: str, up: bool) -> None:
        """Whether a peer shard answers the exchange's reads (peer_exchange.py)."""
        self._peer_answers[peer] = up
        self._count_peers()

    def forget_peer(self, peer: str) -> None:
        """A peer that turned out to be this scheduler: not a peer."""
        self._peer_answers.pop(peer, None)
        self._count_peers()

    def _count_peers(self) -> None:
        answering = sum(self._peer_answers.values())
        self._peers.labels(state="answering").set(answering)
        self._peers.labels(state="silent").set(len(self._peer_answers) - answering)

    def publish(self, stats: CoreStats) -> None:
        self.snapshot = stats

    def add_worker(self, worker_id: str) -> None:
        """Exports the worker's step histogram at zero from its registration on."""
        self._step_seconds.labels(worker=worker_id)

    def observe_step(self, worker_id: str, seconds: float) -> None:
        self._step_seconds.labels(worker=worker_id).observe(seconds)

    def observe_queue_waits(self, waits_s: Iterable[float]) -> None:
        for wait in waits_s:
            self._queue_wait.observe(wait)

    def forget_worker(self, worker_id: str) -> None:
        try:
            self._step_seconds.remove(worker_id)
        except KeyError:
            pass
