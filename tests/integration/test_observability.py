"""Observability of the real stack (four processes, tiny model): one request
id followed through every service's JSON logs, valid Prometheus text with
the catalogued families on every metrics endpoint, every metric the Grafana
dashboard queries exported, and /stats in the documented shape."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.observability import prometheus_names as names
from tests.fixtures.grafana import exported_series_names, grafana_metric_names
from fairserve.launcher.stack import Stack
from tests.integration.helpers import sse_events

ROOT = Path(__file__).resolve().parents[2]
GRAFANA_DASHBOARD = ROOT / "monitoring" / "grafana" / "dashboards" / "fairserve.json"
SERVICE_LOGS = ("gateway", "scheduler", "worker-0", "kvcache")
LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue_wait")


def metrics_urls(stack: Stack) -> dict[str, str]:
    ports = stack.ports
    return {
        names.GATEWAY: f"{stack.url}/metrics",
        names.SCHEDULER: f"http://127.0.0.1:{ports.scheduler_metrics}/metrics",
        names.WORKER: f"http://127.0.0.1:{ports.workers[0][1]}/metrics",
        names.KVCACHE: f"http://127.0.0.1:{ports.kvcache_metrics}/metrics",
    }


def scrape(url: str) -> str:
    reply = httpx.get(url, timeout=10)
    assert reply.status_code == 200, (url, reply.text)
    assert reply.headers["content-type"].startswith("text/plain")
    return reply.text


def eventually(check: Callable[[], object], timeout_s: float = 15.0) -> None:
    """Retries an assertion until it holds (logs and index gauges lag a little)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


def stream(stack: Stack, body: dict, headers: dict[str, str] | None = None) -> httpx.Response:
    with httpx.stream("POST", f"{stack.url}/generate", json={**body, "stream": True},
                      headers=headers or {}, timeout=60) as response:
        response.read()
    return response


@pytest.fixture(scope="module")
def warm_stack(tiny_stack: Stack) -> Stack:
    """The stack after a few requests from two sessions, with a shared prefix."""
    for index in range(4):
        reply = stream(tiny_stack, {"prompt": "The shared prefix of every request here, then "
                                              f"request {index}", "max_tokens": 6, "raw": True,
                                    "ignore_eos": True, "session_id": f"session-{index % 2}"})
        assert reply.status_code == 200, reply.text
    return tiny_stack


def json_lines_with(path: Path, needle: str) -> list[dict]:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if needle in line and line.startswith("{")]


def test_one_request_id_is_found_in_the_logs_of_all_four_services(warm_stack: Stack) -> None:
    request_id = f"obs-{uuid.uuid4().hex[:12]}"
    reply = stream(warm_stack, {"prompt": "Follow me through the logs", "max_tokens": 4, "raw": True,
                                "ignore_eos": True}, headers={"X-Request-ID": request_id})
    assert reply.status_code == 200
    assert reply.headers["x-request-id"] == request_id
    assert sse_events(reply)[-1]["finish_reason"] == "length"

    def found_everywhere() -> None:
        lines = {name: json_lines_with(warm_stack.log_dir / f"{name}.log", request_id)
                 for name in SERVICE_LOGS}
        assert all(lines.values()), {name: len(found) for name, found in lines.items()}
        access = [line for line in lines["gateway"] if line["msg"] == "request"]
        assert access and access[0]["request_id"] == request_id
        assert {"method", "path", "status", "duration_ms"} <= set(access[0])
        assert (access[0]["method"], access[0]["path"], access[0]["status"]) == ("POST", "/generate", 200)
        scheduler_events = {line["msg"] for line in lines["scheduler"]}
        assert {"request queued", "sequence admitted", "request finished"} <= scheduler_events
        assert {"sequence registered", "sequence freed"} <= {line["msg"] for line in lines["worker-0"]}
        lookups = [line for line in lines["kvcache"] if line["msg"] == "lookup"]
        assert lookups and lookups[0]["request_id"] == request_id
        for found in lines.values():
            assert all(request_id in line["request_id"] for line in found)

    eventually(found_everywhere)


@pytest.mark.parametrize("service", names.SERVICES)
def test_metrics_endpoints_serve_valid_prometheus_text_with_every_family(warm_stack: Stack,
                                                                         service: str) -> None:
    url = metrics_urls(warm_stack)[service]

    def every_family_exported() -> None:
        text = scrape(url)
        families = list(text_string_to_metric_families(text))  # raises on invalid text
        assert families
        exported = exported_series_names(text)
        missing = {family.name for family in names.families_of(service)
                   if not set(family.series_names()) <= exported}
        assert missing == set()

    eventually(every_family_exported)


def test_every_metric_a_grafana_panel_queries_is_exported(warm_stack: Stack) -> None:
    # The launcher's families (make run's supervisor) are not the stack's to export.
    queried = {name for name in grafana_metric_names(GRAFANA_DASHBOARD)
               if not name.startswith(f"fairserve_{names.SUPERVISOR}_")}
    assert len(queried) > 20

    def all_exported() -> None:
        exported: set[str] = set()
        for url in metrics_urls(warm_stack).values():
            exported |= exported_series_names(scrape(url))
        assert queried - exported == set()

    eventually(all_exported)


def test_histograms_use_the_llm_buckets(warm_stack: Stack) -> None:
    text = scrape(metrics_urls(warm_stack)[names.GATEWAY])
    buckets = {float(sample.labels["le"]) for family in text_string_to_metric_families(text)
               if family.name == names.GATEWAY_TTFT.name for sample in family.samples
               if sample.name.endswith("_bucket")}
    assert buckets == {*names.GATEWAY_TTFT.buckets, float("inf")}


def test_stats_has_every_part_with_live_numbers(warm_stack: Stack) -> None:
    stats = httpx.get(f"{warm_stack.url}/stats", timeout=10).json()
    assert set(stats) == {"ts", "gateway", "scheduler", "kvcache", "dependencies"}
    assert stats["dependencies"] == {"scheduler": True, "kvcache": True}
    gateway = stats["gateway"]
    assert set(gateway["latency_ms"]) == set(LATENCIES)
    for name in LATENCIES:
        summary = gateway["latency_ms"][name]
        assert summary["count"] > 0, name
        assert summary["p50"] <= summary["p95"] <= summary["p99"]
    assert gateway["totals"]["requests"] >= 4
    assert {s["session_id"] for s in gateway["sessions"]} >= {"session-0", "session-1"}
    scheduler = stats["scheduler"]
    assert scheduler["admitted"] >= 4 and isinstance(scheduler["admitted"], int)
    worker = scheduler["workers"][0]
    assert worker["worker_id"] == "worker-0" and worker["healthy"] is True
    assert {"free_blocks", "cached_blocks", "used_blocks", "total_blocks", "evictions",
            "last_step_ms", "last_batch_size", "steps", "running"} <= set(worker)
    assert worker["steps"] > 0 and worker["total_blocks"] == 512
    assert {c["client_id"] for c in scheduler["clients"]} >= {"session-0", "session-1"}
    kvcache = stats["kvcache"]
    assert kvcache["lookups"] >= 4 and kvcache["hit_tokens"] > 0
    assert kvcache["backend"] == "memory"


def test_the_root_leads_to_the_dashboard(warm_stack: Stack) -> None:
    reply = httpx.get(f"{warm_stack.url}/", follow_redirects=True, timeout=10)
    assert reply.status_code == 200
    assert str(reply.url).endswith("/dashboard/")
    assert "<canvas" in reply.text or "app.js" in reply.text
    assert httpx.get(f"{warm_stack.url}/dashboard/app.js", timeout=10).status_code == 200
