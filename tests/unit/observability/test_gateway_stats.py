"""The gateway feeds its LatencyTracker and metrics from every request, and
/stats answers the documented shape even when services behind it are down."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from common.types import Usage
from services.gateway.app import create_app
from services.gateway.requests.backend import (
    Finish,
    GenerationEvent,
    GenerationSpec,
    Overloaded,
    SchedulerView,
    Unavailable,
    WorkerView,
)
from services.gateway.settings import GatewaySettings
from tests.unit.gateway.fakes import FakeScheduler

LATENCIES = {"ttft", "tpot", "itl", "e2e", "queue_wait"}


class StatsScheduler(FakeScheduler):
    """The fake scheduler, reporting a queue wait and full stats, with
    switches to make the scheduler or the kvcache service unreachable."""

    scheduler_down = False
    kvcache_down = False

    def _finish(self, spec: GenerationSpec, reason: str, produced: int) -> GenerationEvent:
        usage = Usage(len(spec.prompt_token_ids), produced, 0)
        return GenerationEvent(finish=Finish(reason, usage, queue_wait_s=0.025))

    async def scheduler_stats(self) -> SchedulerView:
        if self.scheduler_down:
            raise Unavailable("scheduler did not answer: UNAVAILABLE")
        worker = {"worker_id": "w0", "healthy": True, "running": 1, "free_blocks": 10, "cached_blocks": 2,
                  "used_blocks": 4, "total_blocks": 16, "last_step_ms": 3.5, "last_batch_size": 1,
                  "steps": 9, "evictions": 0}
        return SchedulerView(workers=(WorkerView("w0", "127.0.0.1:1", True),),
                             details={"pending": 0, "prefilling": 0, "active": 1, "workers": [worker]})

    async def kvcache_stats(self) -> dict[str, Any]:
        if self.kvcache_down:
            raise Unavailable("kvcache did not answer: UNAVAILABLE")
        return {"lookups": 3, "hits": 1, "lookup_tokens": 30, "hit_tokens": 8, "nodes": 4,
                "blocks_by_worker": {"w0": 4}, "backend": "memory"}


@pytest.fixture
def scheduler(reply_ids: list[int]) -> StatsScheduler:
    return StatsScheduler(reply_ids=reply_ids)


@pytest.fixture
async def client(tokenizer: Any, scheduler: StatsScheduler) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(GatewaySettings(), scheduler, tokenizer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        yield http


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from tests.fixtures.tiny_model import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def reply_ids(tokenizer: Any) -> list[int]:
    return tokenizer.encode("one two three four five six", add_special_tokens=False)


async def generate(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/generate", json={"prompt": "Hi there", "max_tokens": 4, **body})


async def test_finished_requests_feed_the_tracker_with_every_latency(client: httpx.AsyncClient) -> None:
    assert (await generate(client, session_id="alice")).status_code == 200
    assert (await generate(client, session_id="alice", stream=False)).status_code == 200
    assert (await generate(client, user="bob", stream=False)).status_code == 200
    stats = (await client.get("/stats")).json()
    gateway = stats["gateway"]
    assert {name for name, summary in gateway["latency_ms"].items() if summary["count"]} == LATENCIES
    assert gateway["latency_ms"]["queue_wait"]["p50"] == pytest.approx(25.0)
    assert gateway["latency_ms"]["itl"]["count"] == 3 * 3  # three gaps per four-token reply
    assert gateway["totals"]["requests"] == 3
    assert gateway["totals"]["output_tokens"] == 12
    assert gateway["totals"]["finish_reasons"] == {"length": 3}
    sessions = {s["session_id"]: s["requests"] for s in gateway["sessions"]}
    assert sessions["alice"] == 2 and len(sessions) == 2  # bob's requests go by his client id


async def test_rejections_are_counted_but_leave_latencies_alone(client: httpx.AsyncClient,
                                                                scheduler: StatsScheduler) -> None:
    scheduler.reject = Overloaded("the queue is full")
    assert (await generate(client)).status_code == 429
    stats = (await client.get("/stats")).json()
    assert stats["gateway"]["totals"]["requests"] == 0
    metrics = (await client.get("/metrics")).text
    assert 'fairserve_gateway_requests_total{status="rejected"} 1.0' in metrics
    assert "fairserve_gateway_e2e_latency_seconds_count 0.0" in metrics


async def test_a_failed_generation_counts_as_an_error(client: httpx.AsyncClient,
                                                      scheduler: StatsScheduler) -> None:
    scheduler.finish_error = "worker crashed"
    scheduler.reply_ids = list(scheduler.reply_ids)[:2]  # then the fake ends with the error
    assert (await generate(client, stream=False, max_tokens=8)).status_code == 500
    gateway = (await client.get("/stats")).json()["gateway"]
    assert gateway["totals"]["finish_reasons"] == {"error": 1}
    metrics = (await client.get("/metrics")).text
    assert 'fairserve_gateway_requests_total{status="error"} 1.0' in metrics
    assert "fairserve_gateway_output_tokens_total 2.0" in metrics


async def test_metrics_count_tokens_and_latencies(client: httpx.AsyncClient) -> None:
    await generate(client)
    metrics = (await client.get("/metrics")).text
    assert 'fairserve_gateway_requests_total{status="length"} 1.0' in metrics
    assert "fairserve_gateway_output_tokens_total 4.0" in metrics
    assert "fairserve_gateway_input_tokens_total" in metrics
    assert "fairserve_gateway_tpot_seconds_count 1.0" in metrics
    assert "fairserve_gateway_inter_token_latency_seconds_count 3.0" in metrics
    assert "fairserve_gateway_in_flight_requests 0.0" in metrics


@pytest.mark.parametrize("down", [(), ("scheduler",), ("kvcache",), ("scheduler", "kvcache")])
async def test_stats_keeps_its_shape_and_gives_null_for_a_service_that_is_down(
        client: httpx.AsyncClient, scheduler: StatsScheduler, down: tuple[str, ...]) -> None:
    scheduler.scheduler_down = "scheduler" in down
    scheduler.kvcache_down = "kvcache" in down
    reply = await client.get("/stats")
    assert reply.status_code == 200
    stats = reply.json()
    assert set(stats) == {"ts", "gateway", "scheduler", "kvcache", "dependencies"}
    assert set(stats["dependencies"]) == {"scheduler", "kvcache"}
    assert isinstance(stats["ts"], float) and stats["gateway"]["window_s"] == 60.0
    for part in ("scheduler", "kvcache"):
        assert (stats[part] is None) == (part in down), part
    if "scheduler" not in down:
        assert stats["scheduler"]["workers"][0]["worker_id"] == "w0"


async def test_the_dashboard_is_served_and_the_root_redirects_to_it(client: httpx.AsyncClient) -> None:
    root = await client.get("/")
    assert root.status_code in (302, 307) and root.headers["location"] == "/dashboard/"
    page = await client.get("/dashboard/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "app.js" in page.text
    assert (await client.get("/dashboard/app.js")).status_code == 200
    assert (await client.get("/dashboard/missing.js")).status_code == 404
