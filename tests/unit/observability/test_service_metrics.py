"""Each service's collectors export its catalogued families
(common.observability.prometheus_names), labelled families included, from the start."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from common.observability import prometheus_names as names
from tests.fixtures.grafana import exported_series_names
from services.gateway.observability.metrics import GatewayMetrics
from services.kvcache.kv_types import IndexStats
from services.kvcache.metrics import KvCacheMetrics
from common.step import PoolStats, StepBatch, StepOutput
from services.worker.metrics import WorkerMetrics


def catalogued_series(service: str) -> set[str]:
    return {series for family in names.families_of(service) for series in family.series_names()}


def fairserve_series(registry: CollectorRegistry) -> set[str]:
    return {name for name in exported_series_names(generate_latest(registry).decode())
            if not name.endswith("_created") and name.startswith("fairserve_")}


def scrape(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_the_gateway_exports_its_families_and_every_outcome_at_zero() -> None:
    metrics = GatewayMetrics(CollectorRegistry())
    exported = fairserve_series(metrics.registry)
    labelled_http = {"fairserve_gateway_http_requests_total",
                     *names.GATEWAY_HTTP_REQUEST_DURATION.series_names()}
    # HTTP families appear with their first request (their route is not known before).
    assert exported == catalogued_series(names.GATEWAY) - labelled_http
    text = scrape(metrics.registry)
    for status in ("stop", "length", "cancelled", "error", "rejected"):
        assert f'fairserve_gateway_requests_total{{status="{status}"}} 0.0' in text


def test_the_gateway_access_middleware_view_lands_in_the_catalogued_http_families() -> None:
    metrics = GatewayMetrics(CollectorRegistry())
    metrics.requests.labels(route="/generate", method="POST", status="200").inc()
    metrics.request_duration.labels(route="/generate").observe(0.2)
    metrics.observe_http("GET", "/stats", 200, 0.01)
    text = scrape(metrics.registry)
    assert 'fairserve_gateway_http_requests_total{code="200",method="POST",route="/generate"} 1.0' in text
    assert 'fairserve_gateway_http_request_duration_seconds_count{method="POST",route="/generate"} 1.0' in text
    assert 'fairserve_gateway_http_request_duration_seconds_count{method="GET",route="/stats"} 1.0' in text
    assert fairserve_series(metrics.registry) == catalogued_series(names.GATEWAY)


def test_an_unknown_outcome_counts_as_an_error() -> None:
    metrics = GatewayMetrics(CollectorRegistry())
    metrics.count_outcome("something odd")
    assert 'fairserve_gateway_requests_total{status="error"} 1.0' in scrape(metrics.registry)


def test_the_worker_exports_every_family_and_block_state_from_the_start() -> None:
    pool = PoolStats(total_blocks=64, free_blocks=64, cached_blocks=0, used_blocks=0, evictions=0,
                     prefix_hit_tokens=0, prefix_query_tokens=0)
    registry = CollectorRegistry()
    WorkerMetrics(registry, "worker-7", pool)
    assert fairserve_series(registry) == catalogued_series(names.WORKER)
    text = scrape(registry)
    assert 'fairserve_worker_kv_blocks{state="total",worker="worker-7"} 64.0' in text
    assert 'fairserve_worker_kv_blocks{state="free",worker="worker-7"} 64.0' in text
    assert 'fairserve_worker_tokens_total{kind="sampled",worker="worker-7"} 0.0' in text


def test_the_worker_names_its_engine_in_an_info_series() -> None:
    registry = CollectorRegistry()
    WorkerMetrics(registry, "worker-7", engine_labels={"device": "cpu", "dtype": "float32",
                                                       "linear_kernel": "onednn", "prefill_attention": "sdpa",
                                                       "decode_attention": "native"})
    assert ('fairserve_worker_engine_info{decode_attention="native",device="cpu",dtype="float32",'
            'linear_kernel="onednn",prefill_attention="sdpa",worker="worker-7"} 1.0') in scrape(registry)


def test_the_worker_counts_decode_steps_replayed_from_graphs() -> None:
    pool = PoolStats(total_blocks=8, free_blocks=8, cached_blocks=0, used_blocks=0, evictions=0,
                     prefix_hit_tokens=0, prefix_query_tokens=0)
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "worker-7", pool)
    for replayed in (True, False, True):
        metrics.observe(StepBatch(), StepOutput(results=[], pool=pool, graph_replayed=replayed), running=0)
    assert 'fairserve_worker_decode_graph_steps_total{worker="worker-7"} 2.0' in scrape(registry)


def test_the_worker_counts_logits_rows_by_path() -> None:
    pool = PoolStats(total_blocks=8, free_blocks=8, cached_blocks=0, used_blocks=0, evictions=0,
                     prefix_hit_tokens=0, prefix_query_tokens=0)
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "worker-7", pool)
    metrics.observe(StepBatch(), StepOutput(results=[], pool=pool, screened_rows=5, full_rows=1), running=0)
    metrics.observe(StepBatch(), StepOutput(results=[], pool=pool, screened_rows=2), running=0)
    text = scrape(registry)
    assert 'fairserve_worker_logits_rows_total{path="screened",worker="worker-7"} 7.0' in text
    assert 'fairserve_worker_logits_rows_total{path="full",worker="worker-7"} 1.0' in text


def test_the_kvcache_exports_its_families_and_a_token_hit_rate() -> None:
    metrics = KvCacheMetrics()
    assert 'fairserve_kvcache_hit_rate 0.0' in scrape(metrics.registry)
    metrics.observe_lookup(query_tokens=40, best_tokens=0)
    metrics.observe_lookup(query_tokens=40, best_tokens=30)
    metrics.refresh(IndexStats(nodes=5, blocks_by_worker={"worker-0": 7}))
    text = scrape(metrics.registry)
    assert "fairserve_kvcache_hit_rate 0.375" in text
    assert "fairserve_kvcache_lookups_total 2.0" in text
    assert "fairserve_kvcache_hits_total 1.0" in text
    assert 'fairserve_kvcache_blocks{worker="worker-0"} 7.0' in text
    assert fairserve_series(metrics.registry) == catalogued_series(names.KVCACHE)


def test_the_worker_pool_totals_are_counters_that_never_decrease() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "worker-7")
    for hits in (5, 9, 6, 8):   # 9 -> 6: a step rolled back; the counter holds, then grows by 2
        metrics.observe_pool(PoolStats(total_blocks=8, free_blocks=8, cached_blocks=0, used_blocks=0,
                                       evictions=hits, prefix_hit_tokens=hits, prefix_query_tokens=hits))
    text = scrape(registry)
    assert "# TYPE fairserve_worker_prefix_cache_hit_tokens_total counter" in text
    assert 'fairserve_worker_prefix_cache_hit_tokens_total{worker="worker-7"} 11.0' in text
    assert 'fairserve_worker_kv_evictions_total{worker="worker-7"} 11.0' in text
