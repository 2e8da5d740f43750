"""vLLM's published Grafana dashboard works on fairserve: a real Prometheus
(Debian's `prometheus` package, 2.42 like deploy/compose.yaml's image) scrapes
a running stack's gateway, and every query of every panel returns a series.

The queries are vLLM's, written down from the dashboard its docs publish:
docs.vllm.ai, "Prometheus and Grafana" (examples/observability/prometheus_grafana/
grafana.json in github.com/vllm-project/vllm; the page as of 2026-09-23), one
entry per panel title, in the dashboard's order. `$model_name` is filled from
`label_values(model_name)`, the dashboard's own variable query, and
`$__rate_interval` as Grafana would for a 1 s scrape interval.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fairserve.launcher.stack import Stack
from tests.container.prometheus import query
from tests.unit.gateway.fakes import free_port

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None,
                                reason="no prometheus binary (Debian: apt-get install prometheus)")


def _quantiles(family: str) -> list[str]:
    selector = f'{{model_name="$model_name"}}'
    return [*(f"histogram_quantile({q}, sum by(le) (rate({family}_bucket{selector}[$__rate_interval])))"
              for q in ("0.99", "0.95", "0.9", "0.5")),
            f"rate({family}_sum{selector}[$__rate_interval])\n/\nrate({family}_count{selector}[$__rate_interval])"]


SELECTOR = '{model_name="$model_name"}'
VLLM_PANELS: dict[str, list[str]] = {
    "E2E Request Latency": _quantiles("vllm:e2e_request_latency_seconds"),
    "Token Throughput": [f"rate(vllm:prompt_tokens_total{SELECTOR}[$__rate_interval])",
                         f"rate(vllm:generation_tokens_total{SELECTOR}[$__rate_interval])"],
    "Inter Token Latency": _quantiles("vllm:inter_token_latency_seconds"),
    "Time Per Output Token (TPOT)": _quantiles("vllm:request_time_per_output_token_seconds"),
    "Scheduler State": [f"vllm:num_requests_running{SELECTOR}", f"vllm:num_requests_waiting{SELECTOR}"],
    "Time To First Token Latency": _quantiles("vllm:time_to_first_token_seconds"),
    "Cache Utilization": [f"vllm:kv_cache_usage_perc{SELECTOR}"],
    "Request Prompt Length": [
        f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{SELECTOR}[$__rate_interval]))"],
    "Request Generation Length": [
        f"sum by(le) (increase(vllm:request_generation_tokens_bucket{SELECTOR}[$__rate_interval]))"],
    "Finish Reason": [
        f"sum by(finished_reason) (increase(vllm:request_success_total{SELECTOR}[$__rate_interval]))"],
    "Queue Time": [f"rate(vllm:request_queue_time_seconds_sum{SELECTOR}[$__rate_interval])"],
    "Requests Prefill and Decode Time": [
        f"rate(vllm:request_prefill_time_seconds_sum{SELECTOR}[$__rate_interval])",
        f"rate(vllm:request_decode_time_seconds_sum{SELECTOR}[$__rate_interval])"],
    "Max Generation Token in Sequence Group": [
        f"rate(vllm:request_max_num_generation_tokens_sum{SELECTOR}[$__rate_interval])"],
}
RATE_INTERVAL = "20s"


@pytest.fixture(scope="module")
def prometheus(tiny_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("prometheus")
    gateway = tiny_stack.url.removeprefix("http://")
    config = folder / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                      "scrape_configs:\n  - job_name: gateway\n"
                      f"    static_configs:\n      - targets: ['{gateway}']\n")
    port = free_port()
    process = subprocess.Popen(
        [str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(folder / "prometheus.log").open("w"))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until(lambda: query(url, 'up{job="gateway"} == 1'), 60)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _wait_until(check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
            if result:
                return result
        except (httpx.HTTPError, AssertionError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.5)


def _traffic(stack: Stack) -> None:
    """Requests finished by length, and some that may stop at EOS."""
    for index in range(4):
        body = {"prompt": f"A shared prefix for the dashboard, request {index}", "max_tokens": 6,
                "raw": True, "ignore_eos": index % 2 == 0}
        reply = httpx.post(f"{stack.url}/generate", json=body, timeout=60)
        assert reply.status_code == 200, reply.text


def test_every_panel_of_vllms_dashboard_gets_series(tiny_stack: Stack, prometheus: str) -> None:
    _traffic(tiny_stack)
    models = _wait_until(lambda: httpx.get(f"{prometheus}/api/v1/label/model_name/values",
                                           timeout=10).json()["data"], 30)
    assert len(models) == 1
    time.sleep(3)                      # a few scrapes after the traffic: rates see it
    _traffic(tiny_stack)
    empty: list[str] = []
    for title, queries in VLLM_PANELS.items():
        for expr in queries:
            filled = expr.replace("$model_name", models[0]).replace("$__rate_interval", RATE_INTERVAL)
            try:
                _wait_until(lambda: query(prometheus, filled), 15)
            except AssertionError:
                empty.append(f"{title}: {expr}")
    assert empty == []


def test_the_served_model_labels_the_series_and_tokens_counted(tiny_stack: Stack, prometheus: str) -> None:
    served = httpx.get(f"{tiny_stack.url}/v1/models", timeout=10).json()["data"][0]["id"]
    tokens = _wait_until(lambda: query(prometheus, f'vllm:generation_tokens_total{{model_name="{served}"}} > 0'), 30)
    assert tokens
