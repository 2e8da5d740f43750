"""/stats with API keys: a tenant sees its own clients, users and counters and
nobody else's; an operator key (ADMIN_KEYS, or admin: true in TENANTS_FILE)
sees everyone; without keys nothing changes. METRICS_PORT keeps /metrics off
the public port."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.gateway.app import create_metrics_app
from services.gateway.requests.backend import SchedulerView, WorkerView
from services.gateway.tenancy.tenant_config import load_tenants
from tests.unit.gateway.fakes import FakeScheduler

ALICE_KEY, BOB_KEY, OPS_KEY = "sk-alice-0001", "sk-bob-0002", "sk-ops-0003"
BOB_SESSION, BOB_USER = "bob-session-77", "bob-user-42"
BOB_SERVED = 987654321
KEYS = f"alice={ALICE_KEY},bob={BOB_KEY}"


class TenantScheduler(FakeScheduler):
    """Reports a VTC counter for every client it was sent, as the scheduler
    does, plus fields no allowlist knows (as a later version might add)."""

    async def scheduler_stats(self) -> SchedulerView:
        clients = sorted({request.spec.client_id for request in self.requests})
        served = {"alice": 1111, "bob": BOB_SERVED}
        worker = {"worker_id": "w0", "healthy": True, "running": 1, "total_blocks": 16,
                  "last_clients": clients}
        return SchedulerView(workers=(WorkerView("w0", "127.0.0.1:1", True),), details={
            "pending": 0, "active": 1, "workers": [worker], "policy": "vtc",
            "clients": [{"client_id": name, "counter": served.get(name, 0) / 2.0,
                         "served_tokens": served.get(name, 0), "weight": 1.0} for name in clients],
            "quota_by_tenant": {name: 5 for name in clients}})

    async def kvcache_stats(self) -> dict[str, Any]:
        users = sorted({request.spec.user for request in self.requests})
        return {"lookups": 3, "hit_tokens": 8, "backend": "memory", "recent_users": users}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def scheduler(reply_ids: list[int]) -> TenantScheduler:
    return TenantScheduler(reply_ids=reply_ids)


@pytest.fixture
def connect(make_app: Callable[..., Any],
            scheduler: TenantScheduler) -> Callable[..., httpx.AsyncClient]:
    def build(**settings: Any) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=make_app(scheduler, **settings))
        return httpx.AsyncClient(transport=transport, base_url="http://gateway")
    return build


@pytest.fixture
async def keyed(connect: Callable[..., httpx.AsyncClient]) -> AsyncIterator[httpx.AsyncClient]:
    async with connect(tenants=load_tenants(KEYS, admin_keys=f"ops={OPS_KEY}")) as http:
        await both_tenants_generate(http)
        yield http


async def both_tenants_generate(http: httpx.AsyncClient) -> None:
    for _ in range(2):
        reply = await http.post("/generate", headers=bearer(BOB_KEY), json={
            "prompt": "bob's secret", "session_id": BOB_SESSION, "user": BOB_USER,
            "max_tokens": 3})
        assert reply.status_code == 200, reply.text
    reply = await http.post("/v1/chat/completions", headers=bearer(ALICE_KEY), json={
        "messages": [{"role": "user", "content": "Hi"}], "user": "alice-user-1", "max_tokens": 2})
    assert reply.status_code == 200, reply.text


def assert_no_bob(text: str) -> None:
    for secret in ("bob", BOB_SESSION, BOB_USER, str(BOB_SERVED), BOB_KEY):
        assert secret not in text, secret


async def test_a_tenant_sees_only_its_own(keyed: httpx.AsyncClient) -> None:
    reply = await keyed.get("/stats", headers=bearer(ALICE_KEY))
    assert reply.status_code == 200
    assert_no_bob(reply.text)
    stats = reply.json()
    assert set(stats) == {"ts", "gateway", "scheduler", "kvcache", "dependencies"}
    assert [c["client_id"] for c in stats["scheduler"]["clients"]] == ["alice"]
    assert stats["scheduler"]["clients"][0]["served_tokens"] == 1111
    gateway = stats["gateway"]
    assert gateway["totals"]["requests"] == 1 and gateway["window"]["requests"] == 1
    assert gateway["totals"]["output_tokens"] == 2
    assert [s["session_id"] for s in gateway["sessions"]] == ["alice"]
    assert gateway["latency_ms"]["e2e"]["count"] == 1
    # The shared machine's state stays: the page draws queues and workers.
    assert stats["scheduler"]["pending"] == 0 and stats["scheduler"]["policy"] == "vtc"
    assert stats["scheduler"]["workers"] == [
        {"worker_id": "w0", "healthy": True, "running": 1, "total_blocks": 16}]
    assert stats["kvcache"] == {"lookups": 3, "hit_tokens": 8, "backend": "memory"}
    assert stats["dependencies"] == {"scheduler": True, "kvcache": True}


async def test_bob_sees_himself_and_not_alice(keyed: httpx.AsyncClient) -> None:
    text = (await keyed.get("/stats", headers=bearer(BOB_KEY))).text
    assert BOB_SESSION in text and str(BOB_SERVED) in text
    assert "alice" not in text
    # Alice's served tokens as a number of its own (a timestamp may hold the digits).
    assert not re.search(r"(?<![\d.])1111(?![\d.])", text)


async def test_an_admin_key_sees_every_tenant(keyed: httpx.AsyncClient) -> None:
    stats = (await keyed.get("/stats", headers=bearer(OPS_KEY))).json()
    assert {c["client_id"] for c in stats["scheduler"]["clients"]} == {"alice", "bob"}
    assert {s["session_id"] for s in stats["gateway"]["sessions"]} == {"alice", BOB_SESSION}
    assert stats["gateway"]["totals"]["requests"] == 3
    assert stats["scheduler"]["quota_by_tenant"] == {"alice": 5, "bob": 5}
    assert BOB_USER in json.dumps(stats["kvcache"])


async def test_an_admin_key_is_an_api_key_of_its_own_tenant(keyed: httpx.AsyncClient,
                                                            scheduler: TenantScheduler) -> None:
    reply = await keyed.post("/generate", headers=bearer(OPS_KEY), json={"prompt": "Hi"})
    assert reply.status_code == 200, reply.text
    assert scheduler.requests[-1].spec.client_id == "ops"
    assert (await keyed.get("/stats")).status_code == 401


async def test_admin_true_in_the_tenants_file(connect: Callable[..., httpx.AsyncClient],
                                              tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {"alice": {"admin": True, "weight": 2}}}))
    async with connect(tenants=load_tenants(KEYS, str(path))) as http:
        await both_tenants_generate(http)
        alice = (await http.get("/stats", headers=bearer(ALICE_KEY))).json()
        bob = (await http.get("/stats", headers=bearer(BOB_KEY))).text
    assert {c["client_id"] for c in alice["scheduler"]["clients"]} == {"alice", "bob"}
    assert "alice" not in bob


async def test_without_keys_stats_shows_everyone(connect: Callable[..., httpx.AsyncClient]) -> None:
    async with connect() as http:
        for session in ("s-one", "s-two"):
            await http.post("/generate", json={"prompt": "Hi", "session_id": session})
        stats = (await http.get("/stats")).json()
    assert {c["client_id"] for c in stats["scheduler"]["clients"]} == {"s-one", "s-two"}
    assert {s["session_id"] for s in stats["gateway"]["sessions"]} == {"s-one", "s-two"}
    assert stats["kvcache"]["recent_users"] == [""]


async def test_metrics_port_takes_metrics_off_the_public_port(
        make_app: Callable[..., Any], scheduler: TenantScheduler) -> None:
    app = make_app(scheduler, metrics_port=9109, tenants=load_tenants(KEYS))
    public = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    private = httpx.AsyncClient(transport=httpx.ASGITransport(
        app=create_metrics_app(app.state.gateway)), base_url="http://gateway")
    async with public, private:
        for headers in ({}, bearer(ALICE_KEY)):
            reply = await public.get("/metrics", headers=headers)
            assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"
        metrics = await private.get("/metrics")
        assert metrics.status_code == 200
        assert "fairserve_gateway_dependency_up" in metrics.text
        assert (await private.get("/stats")).status_code == 404


async def test_without_metrics_port_the_public_port_serves_metrics(
        connect: Callable[..., httpx.AsyncClient]) -> None:
    async with connect(tenants=load_tenants(KEYS)) as http:
        assert (await http.get("/metrics")).status_code == 200
