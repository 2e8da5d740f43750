"""The gateway's view of the services behind it: the kvcache index down
leaves it ready but degraded (/health, /stats, the dependency_up gauge),
probes are shared and kept for a moment, and /health never waits on one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from fairserve.v1 import common_pb2, kvindex_pb2, kvindex_pb2_grpc, scheduler_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from common.observability import prometheus_names as names
from common.transport.grpc_server import GrpcServer
from services.gateway.app import create_app
from services.gateway.requests.backend import Readiness
from services.gateway.dependencies import DependencyMonitor
from services.gateway.streaming.scheduler_client import SchedulerClient
from services.gateway.settings import GatewaySettings

from tests.unit.gateway.fakes import FakeScheduler
from tests.unit.gateway.test_scheduler_client import SchedulerServicer


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


class HeldScheduler(FakeScheduler):
    """A fake whose readiness probe waits until `release` is set."""

    release: asyncio.Event | None = None

    async def readiness(self) -> Readiness:
        assert self.release is not None
        await self.release.wait()
        return await super().readiness()


def monitor_of(fake: FakeScheduler, clock: Clock) -> tuple[DependencyMonitor, CollectorRegistry]:
    registry = CollectorRegistry()
    return DependencyMonitor(fake, names.gauge(names.GATEWAY_DEPENDENCY_UP, registry), clock=clock), registry


async def test_probes_are_shared_and_kept_for_a_moment() -> None:
    fake, clock = FakeScheduler(), Clock()
    monitor, registry = monitor_of(fake, clock)
    first, second = await asyncio.gather(monitor.probe(), monitor.probe())
    assert first is second and fake.readiness_probes == 1
    assert await monitor.recent() is first and fake.readiness_probes == 1
    fake.kvcache_serving = False
    clock.now += 1.0
    later = await monitor.recent()
    assert fake.readiness_probes == 2 and later.ready and later.degraded == ("kvcache",)
    text = generate_latest(registry).decode()
    assert 'fairserve_gateway_dependency_up{dependency="kvcache"} 0.0' in text
    assert 'fairserve_gateway_dependency_up{dependency="scheduler"} 1.0' in text


async def test_health_reports_the_last_probe_without_waiting_for_the_next() -> None:
    fake, clock = HeldScheduler(kvcache_serving=False), Clock()
    fake.release = asyncio.Event()
    monitor, _ = monitor_of(fake, clock)
    assert monitor.degraded_now() == []          # nothing known yet; a probe has started
    await asyncio.sleep(0)
    assert monitor.degraded_now() == [] and fake.readiness_probes == 0
    fake.release.set()
    await monitor.recent()
    assert monitor.degraded_now() == ["kvcache"] and fake.readiness_probes == 1
    fake.release.clear()
    clock.now += 5.0
    assert monitor.degraded_now() == ["kvcache"]  # stale: reported as is, the next one started
    fake.kvcache_serving = True
    fake.release.set()
    await monitor.recent()
    assert monitor.degraded_now() == []


async def test_health_answers_while_a_probe_hangs() -> None:
    fake = HeldScheduler()
    fake.release = asyncio.Event()
    app = create_app(GatewaySettings(), fake, tokenizer=None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        reply = await asyncio.wait_for(client.get("/health"), 2)
        assert reply.status_code == 200 and reply.json() == {"status": "ok", "degraded": []}
        fake.release.set()
        await app.state.gateway.dependencies.probe()


class KvIndexServicer(kvindex_pb2_grpc.KvIndexServicer):
    def __init__(self) -> None:
        self.up = True

    async def Stats(self, request: common_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> kvindex_pb2.KvIndexStats:
        if not self.up:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "index backend: Redis unreachable")
        return kvindex_pb2.KvIndexStats(backend="memory")


@pytest.fixture
async def stack() -> AsyncIterator[tuple[SchedulerClient, SchedulerServicer, KvIndexServicer]]:
    scheduler, index = SchedulerServicer(), KvIndexServicer()
    server = GrpcServer([(scheduler_pb2_grpc.add_SchedulerServicer_to_server, scheduler),
                         (kvindex_pb2_grpc.add_KvIndexServicer_to_server, index)],
                        ["fairserve.v1.Scheduler", "fairserve.v1.KvIndex"], "127.0.0.1", 0)
    await server.start()
    scheduler.worker_address = f"127.0.0.1:{server.port}"
    client = SchedulerClient(scheduler.worker_address, scheduler.worker_address)
    yield client, scheduler, index
    await client.close()
    await server.stop(0)


async def test_an_index_that_fails_its_stats_is_down_and_the_gateway_stays_ready(stack: Any) -> None:
    client, _scheduler, index = stack
    assert (await client.readiness()) == Readiness(True, "", (("scheduler", True), ("kvcache", True)))
    index.up = False
    degraded = await client.readiness()
    assert degraded.ready and degraded.degraded == ("kvcache",)
    index.up = True
    assert (await client.readiness()).degraded == ()
