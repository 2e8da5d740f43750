"""LoRA adapters at the gateway: /v1/models lists them with the base as parent, `model` picks
one (its requests carry the adapter and a cache salt apart from the base's), a tenant's
TENANTS_FILE lists the adapters it may use (any other is a 404, as if unknown), and runtime
loading is an operator's, from LORA_ROOT only."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.gateway.tenancy.tenant_config import load_tenants
from tests.unit.gateway.fakes import FakeScheduler

KEYS = "alice=sk-alice,bob=sk-bob"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def write_adapter(directory: Path, weights: bytes = b"weights") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}))
    (directory / "adapter_model.safetensors").write_bytes(weights)
    return directory


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_adapter(tmp_path / "root" / "qv")
    write_adapter(tmp_path / "root" / "sql", b"other weights")
    return tmp_path / "root"


@pytest.fixture
def tenants_file(tmp_path: Path) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {"alice": {"lora_adapters": ["qv"]}, "ops": {"admin": True}}}))
    return str(path)


@pytest.fixture
async def open_client(make_app: Callable[..., Any], fake: FakeScheduler, root: Path
                      ) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(fake, lora_modules={"qv": str(root / "qv"), "sql": str(root / "sql")})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        yield http


@pytest.fixture
async def keyed(make_app: Callable[..., Any], fake: FakeScheduler, root: Path, tenants_file: str
                ) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(fake, tenants=load_tenants(KEYS, tenants_file, admin_keys="ops=sk-ops"),
                   lora_modules={"qv": str(root / "qv"), "sql": str(root / "sql")},
                   lora_root=str(root), lora_runtime_updates=True)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield http


async def test_models_list_the_adapters_with_the_base_as_parent(open_client: httpx.AsyncClient) -> None:
    cards = (await open_client.get("/v1/models")).json()["data"]
    base = cards[0]["id"]
    assert [(card["id"], card["parent"]) for card in cards] == [(base, None), ("qv", base), ("sql", base)]


async def test_model_picks_the_adapter_and_salts_its_cache(open_client: httpx.AsyncClient,
                                                           fake: FakeScheduler) -> None:
    base = (await open_client.get("/v1/models")).json()["data"][0]["id"]
    for model in (base, "qv", "sql"):
        reply = await open_client.post("/v1/chat/completions", json={**CHAT, "model": model})
        assert reply.status_code == 200 and reply.json()["model"] == model
    plain, qv, sql = (sent.spec for sent in fake.requests)
    assert (plain.lora_name, qv.lora_name, sql.lora_name) == ("", "qv", "sql")
    assert qv.lora_digest and qv.lora_digest != sql.lora_digest and qv.lora_path == ""
    assert len({plain.cache_salt, qv.cache_salt, sql.cache_salt}) == 3
    reply = await open_client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "model": "nope"})
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"


async def test_an_adapter_not_allowed_to_a_tenant_is_a_404_as_if_unknown(keyed: httpx.AsyncClient,
                                                                         fake: FakeScheduler) -> None:
    """The attack: bob names alice's adapter. He gets exactly what an unknown name gets, and
    /v1/models does not show it to him."""
    allowed = await keyed.post("/v1/chat/completions", json={**CHAT, "model": "qv"}, headers=bearer("sk-alice"))
    assert allowed.status_code == 200
    refused = await keyed.post("/v1/chat/completions", json={**CHAT, "model": "qv"}, headers=bearer("sk-bob"))
    unknown = await keyed.post("/v1/chat/completions", json={**CHAT, "model": "qw"}, headers=bearer("sk-bob"))
    assert refused.status_code == unknown.status_code == 404
    assert refused.json()["error"]["message"].replace("qv", "X") == unknown.json()["error"]["message"].replace(
        "qw", "X")
    not_listed = await keyed.post("/v1/chat/completions", json={**CHAT, "model": "sql"},
                                  headers=bearer("sk-alice"))
    assert not_listed.status_code == 404
    assert len(fake.requests) == 1 and fake.requests[0].spec.lora_name == "qv"
    listed = {card["id"] for card in (await keyed.get("/v1/models", headers=bearer("sk-bob"))).json()["data"]}
    assert "qv" not in listed and "sql" not in listed
    ops = {card["id"] for card in (await keyed.get("/v1/models", headers=bearer("sk-ops"))).json()["data"]}
    assert {"qv", "sql"} <= ops


async def test_runtime_load_then_unload(keyed: httpx.AsyncClient, root: Path, fake: FakeScheduler) -> None:
    write_adapter(root / "late", b"late weights")
    ops = bearer("sk-ops")
    body = {"lora_name": "late", "lora_path": "late"}
    assert (await keyed.post("/v1/load_lora_adapter", json=body, headers=bearer("sk-alice"))).status_code == 403
    assert (await keyed.post("/v1/load_lora_adapter", json=body, headers=ops)).status_code == 200
    assert (await keyed.post("/v1/load_lora_adapter", json=body, headers=ops)).status_code == 400   # twice
    served = await keyed.post("/v1/chat/completions", json={**CHAT, "model": "late"}, headers=ops)
    assert served.status_code == 200 and fake.requests[-1].spec.lora_path == "late"
    assert (await keyed.post("/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=ops)).status_code == 200
    gone = await keyed.post("/v1/chat/completions", json={**CHAT, "model": "late"}, headers=ops)
    assert gone.status_code == 404
    assert (await keyed.post("/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=ops)).status_code == 404


async def test_runtime_updates_are_off_by_default(open_client: httpx.AsyncClient) -> None:
    reply = await open_client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "qv"})
    assert reply.status_code == 404


async def test_runtime_paths_outside_lora_root_are_refused(keyed: httpx.AsyncClient, root: Path,
                                                           tmp_path: Path) -> None:
    """The attack: an operator key (or a stolen one) names files outside LORA_ROOT, directly, by
    `..`, or through symlinks inside it: every one is a 400 that reads nothing and echoes no path."""
    outside = write_adapter(tmp_path / "outside")
    os.symlink(outside, root / "link-out")
    inner = root / "inner"
    inner.mkdir()
    os.symlink(tmp_path / "secret.json", inner / "adapter_config.json")
    (tmp_path / "secret.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    (inner / "adapter_model.safetensors").write_bytes(b"x")
    ops = bearer("sk-ops")
    for path in (str(outside), "../outside", "link-out", "inner", "/etc", "qv/../../outside", "missing"):
        reply = await keyed.post("/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": path},
                                 headers=ops)
        assert reply.status_code == 400, path
        assert reply.json()["error"]["param"] == "lora_path"
        assert str(tmp_path) not in reply.text
    assert "evil" not in {card["id"] for card in (await keyed.get("/v1/models", headers=ops)).json()["data"]}


def test_tenants_file_lora_adapters(tmp_path: Path) -> None:
    from common.settings.env import SettingsError

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"defaults": {"lora_adapters": ["qv"]},
                                "tenants": {"alice": {"lora_adapters": "*"}, "bob": {"weight": 2}}}))
    registry = load_tenants("alice=sk-a,bob=sk-b,carol=sk-c", str(path))
    alice, bob = registry.tenant("alice"), registry.tenant("bob")
    assert alice.may_use_adapter("anything") and bob.may_use_adapter("qv") and not bob.may_use_adapter("sql")
    assert not load_tenants("carol=sk-c").tenant("carol").may_use_adapter("qv")   # unset: none
    path.write_text(json.dumps({"tenants": {"alice": {"lora_adapters": ["ok", "../bad"]}}}))
    with pytest.raises(SettingsError, match="tenant 'alice' field 'lora_adapters'"):
        load_tenants("alice=sk-a", str(path))


async def test_unloading_lets_a_running_request_finish(keyed: httpx.AsyncClient, root: Path,
                                                       fake: FakeScheduler) -> None:
    import asyncio

    fake.token_delay_s = 0.05
    ops = bearer("sk-ops")
    write_adapter(root / "busy", b"busy weights")
    assert (await keyed.post("/v1/load_lora_adapter", json={"lora_name": "busy", "lora_path": "busy"},
                             headers=ops)).status_code == 200
    running = asyncio.ensure_future(keyed.post("/v1/chat/completions", json={**CHAT, "model": "busy"},
                                               headers=ops))
    while not fake.requests:
        await asyncio.sleep(0.01)
    assert (await keyed.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}, headers=ops)).status_code == 200
    finished = await running
    assert finished.status_code == 200 and finished.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_bad_lora_module_stops_the_gateway_naming_it(tmp_path: Path) -> None:
    from common.settings.env import SettingsError
    from services.gateway.models.lora_catalog import LoraCatalog

    with pytest.raises(SettingsError, match="LORA_MODULES adapter 'gone'"):
        LoraCatalog.from_modules("base", {"gone": str(tmp_path / "missing")})
    bad = write_adapter(tmp_path / "dora")
    (bad / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8, "use_dora": True}))
    with pytest.raises(SettingsError, match="use_dora=true is not supported"):
        LoraCatalog.from_modules("base", {"dora": str(bad)})


async def test_one_adapter_of_two_tenants_keeps_their_caches_apart(keyed: httpx.AsyncClient,
                                                                   fake: FakeScheduler) -> None:
    """The attack: a tenant allowed the same adapter as another probes its cached prompts. The
    adapter joins the tenant's salt, never replaces it."""
    for key in ("sk-alice", "sk-ops"):
        assert (await keyed.post("/v1/chat/completions", json={**CHAT, "model": "qv"},
                                 headers=bearer(key))).status_code == 200
    alice, ops = (sent.spec for sent in fake.requests)
    assert alice.lora_name == ops.lora_name == "qv" and alice.cache_salt != ops.cache_salt
    assert alice.cache_salt.startswith("alice")
