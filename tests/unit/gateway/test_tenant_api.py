"""Tenants through the HTTP and gRPC doors: keys authenticate to tenants,
the tenant is the fairness client, and no raw key leaves the gateway."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.observability.logs import JsonFormatter
from services.gateway.tenancy.api_keys import metadata_key, presented_key
from services.gateway.tenancy.tenant_config import load_tenants
from services.gateway.tenancy.tenants import derived_name
from tests.unit.gateway.fakes import FakeScheduler

SECRET_A = "sk-live-SECRET-alice"
SECRET_BARE = "sk-live-SECRET-bare"
KEYS = f"alice={SECRET_A},{SECRET_BARE}"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def bearer(key: str | bytes) -> dict[str, bytes]:
    raw = key.encode() if isinstance(key, str) else key
    return {"authorization": b"Bearer " + raw}


@pytest.fixture
def tenants_file(tmp_path: Path) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {"alice": {"weight": 3, "max_priority": 2}}}))
    return str(path)


@pytest.fixture
async def keyed(make_app: Callable[..., Any], fake: FakeScheduler,
                tenants_file: str) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(fake, tenants=load_tenants(KEYS, tenants_file))   # PREFIX_CACHE_SCOPE unset
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield http


def test_presented_key_reads_raw_bytes() -> None:
    assert presented_key([(b"authorization", b"Bearer sk-1")]) == b"sk-1"
    assert presented_key([(b"Authorization", b"bearer   sk-1  ")]) == b"sk-1"
    assert presented_key([(b"x-api-key", b"sk-2")]) == b"sk-2"
    assert presented_key([(b"authorization", b"Basic abc"), (b"x-api-key", b"sk-2")]) == b"sk-2"
    assert presented_key([(b"authorization", b"Bearer a"), (b"authorization", b"Bearer b")]) == b"a"
    for bad in (b"Bearer", b"Bearer ", b"Bearer \xff\xfe", b"Bearer sk\x80", b"Bearer a\x00b",
                b"Bearer a b", b"\xc3\xa9", b""):
        assert presented_key([(b"authorization", bad)]) is None, bad
    assert presented_key([]) is None
    assert metadata_key([("authorization", "Bearer sk-é")]) is None
    assert metadata_key([("x-api-key", b"sk-3")]) == b"sk-3"
    assert metadata_key(None) is None


async def test_malformed_authorization_is_401_never_500(keyed: httpx.AsyncClient) -> None:
    for headers in ({}, bearer(b"\xff\xfe\xfd"), bearer(b"sk-live-SECRET-alice\x80"),
                    {"authorization": b"\xc3\xa9\xc3\xa9"}, {"x-api-key": b"\x80" * 300},
                    bearer(SECRET_A + "x"), bearer(SECRET_A[:-1]), {"authorization": SECRET_A}):
        for path in ("/v1/chat/completions", "/generate"):
            reply = await keyed.post(path, json={**CHAT, "prompt": "Hi", "stream": False},
                                     headers=headers)
            assert reply.status_code == 401, (headers, reply.text)
            assert reply.json()["error"]["code"] == "invalid_api_key"
    assert (await keyed.get("/v1/models", headers=bearer(b"\xff"))).status_code == 401
    assert (await keyed.get("/health", headers=bearer(b"\xff"))).status_code == 200


async def test_the_tenant_is_the_client(keyed: httpx.AsyncClient, fake: FakeScheduler) -> None:
    reply = await keyed.post("/v1/chat/completions", headers=bearer(SECRET_A), json={
        **CHAT, "user": "end-user-7", "session_id": "s-9", "priority": 50})
    assert reply.status_code == 200, reply.text
    spec = fake.requests[-1].spec
    assert (spec.client_id, spec.user, spec.session_id) == ("alice", "end-user-7", "s-9")
    assert (spec.weight, spec.priority, spec.cache_salt) == (3.0, 2, "alice")
    reply = await keyed.post("/generate", headers={"x-api-key": SECRET_BARE},
                             json={"prompt": "Hi", "stream": False, "session_id": "s-1",
                                   "priority": -4})
    assert reply.status_code == 200, reply.text
    spec = fake.requests[-1].spec
    bare = derived_name(SECRET_BARE.encode())
    assert (spec.client_id, spec.user, spec.session_id) == (bare, "s-1", "s-1")
    assert (spec.weight, spec.priority, spec.cache_salt) == (1.0, -4, bare)


@pytest.mark.parametrize("scope, alice_salts_differ, bob_shares_alices", [
    ("user", True, False), ("global", False, True)])
async def test_the_cache_scope_reaches_every_door(make_app: Callable[..., Any], fake: FakeScheduler,
                                                  tenants_file: str, scope: str, alice_salts_differ: bool,
                                                  bob_shares_alices: bool) -> None:
    app = make_app(fake, tenants=load_tenants(KEYS, tenants_file), prefix_cache_scope=scope)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    salts = []
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        for key, user in ((SECRET_A, "u1"), (SECRET_A, "u2"), (SECRET_BARE, "u1")):
            reply = await http.post("/v1/chat/completions", headers=bearer(key), json={**CHAT, "user": user})
            assert reply.status_code == 200, reply.text
            salts.append(fake.requests[-1].spec.cache_salt)
            reply = await http.post("/generate", headers=bearer(key),
                                    json={"prompt": "Hi", "stream": False, "user": user})
            assert reply.status_code == 200 and fake.requests[-1].spec.cache_salt == salts[-1]
    assert (salts[0] != salts[1]) is alice_salts_differ
    assert (salts[2] == salts[0]) is bob_shares_alices


@pytest.fixture
def captured_logs() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("gateway"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


async def test_no_raw_key_in_stats_metrics_or_logs(keyed: httpx.AsyncClient, fake: FakeScheduler,
                                                   captured_logs: io.StringIO) -> None:
    for key in (SECRET_A, SECRET_BARE):
        for body in (CHAT, {**CHAT, "stream": True}, {**CHAT, "user": "u1"},
                     {**CHAT, "session_id": "s1"}, {**CHAT, "temperature": 9}):
            await keyed.post("/v1/chat/completions", headers=bearer(key), json=body)
        await keyed.post("/generate", headers={"x-api-key": key}, json={"prompt": "Hi"})
        await keyed.post("/v1/completions", headers=bearer(key + "-wrong"), json={"prompt": "x"})
    stats = (await keyed.get("/stats", headers=bearer(SECRET_A))).text
    metrics = (await keyed.get("/metrics")).text
    logs = captured_logs.getvalue()
    sent = repr([request.spec for request in fake.requests])
    assert "alice" in stats   # and, private, not the other tenant (test_private_stats.py)
    assert derived_name(SECRET_BARE.encode()) not in stats
    assert "request" in logs  # the access log was captured
    for text in (stats, metrics, logs, sent):
        assert "SECRET" not in text
