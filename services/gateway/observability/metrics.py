"""The gateway's Prometheus metrics (the gateway families of
common.observability.prometheus_names, and vLLM's beside them), registered on a registry the
app owns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from common.observability import prometheus_names as names
from common.model_store import DEFAULT_MODEL_ID
from services.gateway.observability.vllm_metrics import VllmMetrics

# Outcomes of a generation request; each is exported from the start at 0.
REQUEST_STATUSES = ("stop", "length", "cancelled", "error", "rejected")


class _AccessLogView:
    """How the access middleware (middleware.py) records a request:
    requests.labels(route, method, status).inc(), then at once
    request_duration.labels(route).observe(seconds). Both land in the
    catalogued HTTP families; the method of the first call labels the second
    (no await comes between them, so requests cannot interleave)."""

    def __init__(self, counter: Counter, histogram: Histogram) -> None:
        self._counter = counter
        self._histogram = histogram
        self._method = ""

    def count(self, route: str, method: str, status: str) -> Counter:
        self._method = method
        return self._counter.labels(method=method, route=route, code=status)

    def time(self, route: str) -> Histogram:
        return self._histogram.labels(method=self._method, route=route)


@dataclass(frozen=True)
class _Labeller:
    labels: Callable[..., Counter | Histogram]


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str = DEFAULT_MODEL_ID) -> None:
        self.registry = registry
        # vLLM's families beside fairserve's own (vllm_metrics.py).
        self.vllm = VllmMetrics(registry, model_name)
        self.http_requests = names.counter(names.GATEWAY_HTTP_REQUESTS, registry)
        self.http_duration = names.histogram(names.GATEWAY_HTTP_REQUEST_DURATION, registry)
        outcomes = names.counter(names.GATEWAY_REQUESTS, registry)
        self.outcomes = {status: outcomes.labels(status=status) for status in REQUEST_STATUSES}
        self.in_flight = names.gauge(names.GATEWAY_IN_FLIGHT, registry)
        self.ttft = names.histogram(names.GATEWAY_TTFT, registry)
        self.tpot = names.histogram(names.GATEWAY_TPOT, registry)
        self.inter_token = names.histogram(names.GATEWAY_INTER_TOKEN, registry)
        self.e2e = names.histogram(names.GATEWAY_E2E, registry)
        self.input_tokens = names.counter(names.GATEWAY_INPUT_TOKENS, registry)
        self.output_tokens = names.counter(names.GATEWAY_OUTPUT_TOKENS, registry)
        lookups = names.counter(names.GATEWAY_PROMPT_TOKENS_CACHE, registry)
        self.prompt_tokens_cache = {result: lookups.labels(result=result) for result in ("hit", "miss", "prefix")}
        # Set by each readiness probe (dependencies.py); 0 until the first.
        self.dependency_up = names.gauge(names.GATEWAY_DEPENDENCY_UP, registry)
        for dependency in ("scheduler", "kvcache"):
            self.dependency_up.labels(dependency=dependency)
        access = _AccessLogView(self.http_requests, self.http_duration)
        # The names the access middleware records with (see _AccessLogView).
        self.requests = _Labeller(access.count)
        self.request_duration = _Labeller(access.time)

    def observe_http(self, method: str, route: str, status: int | str, duration_s: float) -> None:
        self.http_requests.labels(method=method, route=route, code=str(status)).inc()
        self.http_duration.labels(method=method, route=route).observe(duration_s)

    def count_outcome(self, status: str) -> None:
        self.outcomes[status if status in self.outcomes else "error"].inc()
