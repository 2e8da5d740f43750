"""Prometheus metrics of the scheduler, named as catalogued in
common.prometheus_names.

Queue lengths, totals, per-worker health and per-client counters are read
at scrape time from the latest stats snapshot, which the event loop
publishes; the scrape thread never touches the core. Step round trips and
queue waits are observed as they happen."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common import prometheus_names as names

from services.scheduler.core import CoreStats, FinishReason, Gate

# Every label value is exported from the start, at 0, so rates work at once.
REJECTION_GATES = (Gate.QUEUE, Gate.NEVER_FIT, Gate.TIMEOUT, Gate.NO_WORKER, Gate.INVALID)
HOLD_GATES = (Gate.ACTIVE_KV, Gate.CACHE_POOL)


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


class _StatsCollector(Collector):
    def __init__(self, metrics: SchedulerMetrics) -> None:
        self._metrics = metrics

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
        yield _by_label(names.SCHEDULER_HOLDS,
                        _with_zeros(stats.holds, (g.value for g in HOLD_GATES)), CounterMetricFamily)
        reserved = _gauge(names.SCHEDULER_RESERVED_KV_TOKENS)
        reserved.add_metric([], stats.reserved_kv_tokens)
        yield reserved
        yield _by_label(names.SCHEDULER_WORKER_HEALTHY,
                        [(w.worker_id, 1.0 if w.healthy else 0.0) for w in stats.workers], GaugeMetricFamily)
        yield _by_label(names.SCHEDULER_WORKER_BATCH_SIZE,
                        [(w.worker_id, w.last_batch_size) for w in stats.workers], GaugeMetricFamily)
        yield _by_label(names.SCHEDULER_CLIENT_VTC, [(c.client_id, c.counter) for c in stats.clients],
                        GaugeMetricFamily)
        yield _by_label(names.SCHEDULER_CLIENT_SERVED_TOKENS,
                        [(c.client_id, c.served_tokens) for c in stats.clients], CounterMetricFamily)
        yield _by_label(names.SCHEDULER_POLICY, [(stats.policy.value, 1.0)], GaugeMetricFamily)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.snapshot: CoreStats | None = None
        self.registry.register(_StatsCollector(self))
        step = names.SCHEDULER_WORKER_STEP
        self._step_seconds = Histogram(step.name, step.help, list(step.labels), buckets=step.buckets,
                                       registry=self.registry)
        wait = names.SCHEDULER_QUEUE_WAIT
        self._queue_wait = Histogram(wait.name, wait.help, buckets=wait.buckets, registry=self.registry)

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
