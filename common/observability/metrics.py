"""Metric names and the per-service Prometheus endpoint.

Naming scheme: fairserve_<service>_<what>_<unit>, counters end in _total.
Latency histograms share LATENCY_BUCKETS_S, spaced for LLM serving (TTFT
and end-to-end latencies from milliseconds to minutes).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

PREFIX = "fairserve"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                     1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                           0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)


def metric_name(service: str, what: str) -> str:
    return f"{PREFIX}_{service}_{what}"


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "127.0.0.1") -> int:
    """Starts the /metrics HTTP endpoint in a daemon thread; returns the port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server.server_port
