"""The gateway's vLLM-compatible families (services/gateway/observability/vllm_metrics.py):
vLLM's names with the model_name label from the start, what one request adds
to each, the engine gauges from the scheduler's Stats, and counters that only
grow."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.observability.vllm_metrics import REFRESH_S, RequestTimes, VllmMetrics, engine_state
from tests.unit.gateway.fakes import FakeScheduler

MODEL = "org/model-a"
# The families issue 41 names, and the ones vLLM's Grafana dashboard also reads.
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
            "vllm:generation_tokens", "vllm:request_success")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_time_per_output_token_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
              "vllm:request_max_num_generation_tokens")


def families(registry: CollectorRegistry) -> dict[str, Any]:
    return {family.name: family for family in
            text_string_to_metric_families(generate_latest(registry).decode())}


def value(registry: CollectorRegistry, sample_name: str, **labels: str) -> float:
    for family in families(registry).values():
        for sample in family.samples:
            if sample.name == sample_name and sample.labels == {"model_name": MODEL, **labels}:
                return sample.value
    raise AssertionError(f"no sample {sample_name} {labels}")


def test_every_family_has_its_vllm_type_and_the_model_name_label_from_the_start() -> None:
    registry = CollectorRegistry()
    VllmMetrics(registry, MODEL)
    found = families(registry)
    for name in COUNTERS:
        assert found[name].type == "counter", name
    for name in GAUGES:
        assert found[name].type == "gauge", name
    for name in (*COUNTERS, *GAUGES):
        assert all(s.labels["model_name"] == MODEL for s in found[name].samples), name
        assert found[name].samples, name
    for name in HISTOGRAMS:
        assert found[name].type == "histogram", name
    reasons = {s.labels["finished_reason"] for s in found["vllm:request_success"].samples
               if s.name == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error"}


def test_one_request_lands_in_each_family() -> None:
    registry = CollectorRegistry()
    metrics = VllmMetrics(registry, MODEL)
    metrics.first_token(0.5)
    metrics.token(None)
    metrics.token(0.1)
    metrics.token(0.1)
    metrics.ended("length", RequestTimes(prompt_tokens=10, generation_tokens=3, cached_tokens=4,
                                         max_tokens=3, e2e_s=0.7, ttft_s=0.5, decode_s=0.2, queue_s=0.25))
    assert value(registry, "vllm:generation_tokens_total") == 3
    assert value(registry, "vllm:prompt_tokens_total") == 10
    assert value(registry, "vllm:prefix_cache_queries_total") == 10
    assert value(registry, "vllm:prefix_cache_hits_total") == 4
    assert value(registry, "vllm:request_success_total", finished_reason="length") == 1
    assert value(registry, "vllm:inter_token_latency_seconds_count") == 2
    assert value(registry, "vllm:time_to_first_token_seconds_sum") == 0.5
    assert value(registry, "vllm:request_queue_time_seconds_sum") == 0.25
    assert abs(value(registry, "vllm:request_prefill_time_seconds_sum") - 0.25) < 1e-9
    assert abs(value(registry, "vllm:request_decode_time_seconds_sum") - 0.2) < 1e-9
    assert abs(value(registry, "vllm:request_time_per_output_token_seconds_sum") - 0.1) < 1e-9
    assert value(registry, "vllm:request_max_num_generation_tokens_sum") == 3


def test_a_cancelled_request_is_an_abort_and_a_refused_one_counts_nowhere() -> None:
    registry = CollectorRegistry()
    metrics = VllmMetrics(registry, MODEL)
    times = RequestTimes(4, 0, 0, 8, e2e_s=0.1, ttft_s=None, decode_s=None, queue_s=None)
    metrics.ended("cancelled", times)
    metrics.ended("rejected", times)
    assert value(registry, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(registry, "vllm:prompt_tokens_total") == 4
    assert value(registry, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(registry, "vllm:request_prefill_time_seconds_count") == 0


def test_hits_never_exceed_queries() -> None:
    registry = CollectorRegistry()
    VllmMetrics(registry, MODEL).ended("stop", RequestTimes(5, 1, 99, 1, 0.1, 0.1, 0.0, 0.0))
    assert value(registry, "vllm:prefix_cache_hits_total") == 5


def test_engine_state_sums_the_healthy_workers() -> None:
    details = {"pending": 3, "prefilling": 1, "active": 4, "workers": [
        {"healthy": True, "used_blocks": 30, "total_blocks": 100},
        {"healthy": True, "used_blocks": 10, "total_blocks": 100},
        {"healthy": False, "used_blocks": 100, "total_blocks": 100}]}
    state = engine_state(details)
    assert (state.running, state.waiting, state.kv_usage) == (5, 3, 0.2)
    assert engine_state({}).kv_usage == 0.0
    assert engine_state({"workers": 2}).running == 0   # not a list: no worker counted


def test_refresh_asks_the_scheduler_at_most_once_per_interval_and_keeps_values_on_failure() -> None:
    now = [100.0]
    calls: list[int] = []
    registry = CollectorRegistry()
    metrics = VllmMetrics(registry, MODEL, clock=lambda: now[0])

    async def details() -> dict[str, Any]:
        calls.append(1)
        if len(calls) > 1:
            raise TimeoutError
        return {"pending": 7, "active": 2, "workers": [{"healthy": True, "used_blocks": 1, "total_blocks": 4}]}

    async def scrapes() -> None:
        await asyncio.gather(*(metrics.refresh(details) for _ in range(5)))
        await metrics.refresh(details)
        now[0] += REFRESH_S
        await metrics.refresh(details)    # fails: the last values stay

    asyncio.run(scrapes())
    assert len(calls) == 2
    assert value(registry, "vllm:num_requests_waiting") == 7
    assert value(registry, "vllm:num_requests_running") == 2
    assert value(registry, "vllm:kv_cache_usage_perc") == 0.25


async def test_the_gateway_metrics_endpoint_serves_them_for_its_model(make_app, reply_ids) -> None:
    """The label is the first served name (SERVED_MODEL_NAME), never MODEL_NAME's path."""
    fake = FakeScheduler(reply_ids=reply_ids, cached_tokens=2)
    app = make_app(fake, model_name="/srv/models/model-a-f32", served_model_names=(MODEL, "alias"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        reply = await http.post("/generate", json={"prompt": "hello there", "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        text = (await http.get("/metrics")).text
    assert f'vllm:generation_tokens_total{{model_name="{MODEL}"}} 4.0' in text
    assert f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}} 1.0' in text
    assert f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}} 2.0' in text
    assert f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0' in text


async def test_without_served_names_the_label_is_the_model_directorys_name(make_app, reply_ids) -> None:
    app = make_app(FakeScheduler(reply_ids=reply_ids), model_name="/srv/models/tiny-chat/")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        text = (await http.get("/metrics")).text
    assert 'vllm:num_requests_waiting{model_name="tiny-chat"} 0.0' in text and "/srv/models" not in text
