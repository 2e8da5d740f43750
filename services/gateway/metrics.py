"""The gateway's Prometheus metrics, registered on a registry the app owns."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.metrics import LATENCY_BUCKETS_S, TOKEN_LATENCY_BUCKETS_S, metric_name

SERVICE = "gateway"


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            metric_name(SERVICE, "requests_total"), "HTTP requests by route, method and status",
            ["route", "method", "status"], registry=registry)
        self.request_duration = Histogram(
            metric_name(SERVICE, "request_duration_seconds"), "HTTP request duration",
            ["route"], buckets=LATENCY_BUCKETS_S, registry=registry)
        self.ttft = Histogram(
            metric_name(SERVICE, "ttft_seconds"), "Time to first token",
            buckets=LATENCY_BUCKETS_S, registry=registry)
        self.e2e = Histogram(
            metric_name(SERVICE, "e2e_latency_seconds"), "Generation time, first byte in to last token out",
            buckets=LATENCY_BUCKETS_S, registry=registry)
        self.inter_token = Histogram(
            metric_name(SERVICE, "inter_token_latency_seconds"), "Time between streamed tokens",
            buckets=TOKEN_LATENCY_BUCKETS_S, registry=registry)
        self.generated_tokens = Counter(
            metric_name(SERVICE, "generated_tokens_total"), "Tokens received from the scheduler",
            registry=registry)
        self.prompt_tokens = Counter(
            metric_name(SERVICE, "prompt_tokens_total"), "Prompt tokens sent to the scheduler",
            registry=registry)
        self.finished = Counter(
            metric_name(SERVICE, "generations_total"), "Generations by finish reason",
            ["finish_reason"], registry=registry)
        self.in_flight = Gauge(
            metric_name(SERVICE, "generations_in_flight"), "Generations streaming now",
            registry=registry)
