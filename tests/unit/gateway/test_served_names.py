"""Models by name: SERVED_MODEL_NAME is what /v1/models lists and what every door's `model` must
name (a served name or an adapter the caller may use); anything else is vLLM's 404, the same for
an adapter a tenant may not use as for a name that does not exist; /version."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from common.settings.env import SettingsError
from common.version import package_version
from services.gateway.models.served_names import default_served_name, served_names
from services.gateway.settings import GatewaySettings
from services.gateway.tenancy.tenant_config import load_tenants
from tests.unit.gateway.fakes import FakeScheduler, ServerThread
from tests.unit.gateway.test_lora_api import bearer, write_adapter

NAMES = ("my-model", "org/alias")
MESSAGES = [{"role": "user", "content": "Hi"}]
# Each door that takes a `model`, with a body that is valid apart from it.
DOORS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "stream": True}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "stream": True}),
    ("/generate", {"prompt": "Hi", "max_tokens": 2, "stream": False}),
    ("/generate", {"prompt": "Hi", "max_tokens": 2}),
    ("/tokenize", {"prompt": "Hi"}),
    ("/detokenize", {"tokens": [1, 2]}),
]
GENERATING = [door for door in DOORS if door[0] not in ("/tokenize", "/detokenize")]


def not_found(model: str) -> dict[str, Any]:
    return {"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                      "param": "model", "code": 404}}


@pytest.fixture
async def named(make_app: Callable[..., Any], fake: FakeScheduler) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(fake, model_name="/srv/models/gemma-f32", served_model_names=NAMES)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        yield http


@pytest.fixture
async def tenanted(make_app: Callable[..., Any], fake: FakeScheduler, tmp_path: Path
                   ) -> AsyncIterator[httpx.AsyncClient]:
    """alice may use adapter `secret-ft`; bob may use none."""
    tenants_file = tmp_path / "tenants.json"
    tenants_file.write_text(json.dumps({"tenants": {"alice": {"lora_adapters": ["secret-ft"]}}}))
    app = make_app(fake, served_model_names=NAMES,
                   tenants=load_tenants("alice=sk-alice,bob=sk-bob", str(tenants_file)),
                   lora_modules={"secret-ft": str(write_adapter(tmp_path / "secret-ft"))})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        yield http


# -- settings -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("model_name", "expected"), [
    ("", "gemma-3-270m"), ("google/gemma-3-270m", "gemma-3-270m"), ("/srv/models/llama-3-8b", "llama-3-8b"),
    ("/srv/models/llama-3-8b/", "llama-3-8b"), ("./qwen", "qwen"), ("~/m/phi", "phi")])
def test_the_default_name_is_model_names_last_path_component(model_name: str, expected: str) -> None:
    assert default_served_name(model_name) == expected
    assert GatewaySettings.from_env({"MODEL_NAME": model_name}).model_names == (expected,)


def test_several_names_in_order_the_first_canonical() -> None:
    settings = GatewaySettings.from_env({"SERVED_MODEL_NAME": " my-model , org/alias,", "MODEL_NAME": "/srv/x"})
    assert settings.model_names == NAMES and settings.model_id == "my-model"
    assert served_names("  ", "/srv/x") == ("x",)


@pytest.mark.parametrize("value", ["my model", "-dash", "a,a", "x" * 129, "bad\nname", "../up"])
def test_bad_served_names_are_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(SettingsError, match="SERVED_MODEL_NAME"):
        GatewaySettings.from_env({"SERVED_MODEL_NAME": value})


def test_an_adapter_may_not_take_a_served_name(tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "a")
    with pytest.raises(SettingsError, match="LORA_MODULES adapter 'alias'"):
        GatewaySettings.from_env({"SERVED_MODEL_NAME": "main,alias", "LORA_MODULES": f"alias={adapter}"})


# -- /v1/models -----------------------------------------------------------------------------------

async def test_models_list_each_served_name_in_vllms_shape_and_no_path(named: httpx.AsyncClient,
                                                                        fake: FakeScheduler) -> None:
    reply = await named.get("/v1/models")
    assert reply.status_code == 200 and reply.json()["object"] == "list"
    cards = reply.json()["data"]
    assert [card["id"] for card in cards] == list(NAMES)
    for card in cards:
        assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"}
        assert card["object"] == "model" and card["owned_by"] == "fairserve" and card["parent"] is None
        assert card["root"] == "my-model" and isinstance(card["created"], int)
        assert card["max_model_len"] == fake.model_len
    assert "/srv" not in reply.text


async def test_without_served_names_the_one_listed_is_the_directorys_name(make_app: Callable[..., Any],
                                                                          fake: FakeScheduler) -> None:
    app = make_app(fake, model_name="/srv/models/tiny-chat")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        cards = (await http.get("/v1/models")).json()["data"]
    assert [(card["id"], card["root"]) for card in cards] == [("tiny-chat", "tiny-chat")]


# -- requests -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body"), DOORS)
async def test_an_unknown_model_is_vllms_404_on_every_door(named: httpx.AsyncClient, fake: FakeScheduler,
                                                           path: str, body: dict[str, Any]) -> None:
    for model in ("nope", "/srv/models/gemma-f32", "gemma-f32", "My-Model", "google/gemma-3-270m"):
        reply = await named.post(path, json={**body, "model": model})
        assert reply.status_code == 404 and reply.json() == not_found(model), (path, model)
    assert fake.requests == []


@pytest.mark.parametrize(("path", "body"), DOORS)
async def test_every_served_name_and_no_name_are_the_base_model(named: httpx.AsyncClient, fake: FakeScheduler,
                                                                path: str, body: dict[str, Any]) -> None:
    for model in (*NAMES, None, ""):
        sent = {**body, "model": model} if model is not None else body
        reply = await named.post(path, json=sent)
        assert reply.status_code == 200, (path, model, reply.text)
        if path.startswith("/v1/") and not body.get("stream"):
            assert reply.json()["model"] == "my-model"     # the canonical name, as vLLM answers
    assert all(request.spec.lora_name == "" for request in fake.requests)


def test_the_openai_sdk_lists_and_uses_a_served_name(serve: Callable[..., ServerThread],
                                                     fake: FakeScheduler) -> None:
    client = openai.OpenAI(base_url=f"{serve(fake, served_model_names=NAMES).url}/v1", api_key="unused",
                           max_retries=0, timeout=10)
    assert [model.id for model in client.models.list()] == list(NAMES)
    reply = client.chat.completions.create(model="org/alias", messages=MESSAGES, max_tokens=2)
    assert reply.model == "my-model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    assert missing.value.status_code == 404 and missing.value.body == not_found("nope")["error"]


async def test_an_adapter_is_served_on_the_generate_and_responses_doors(tenanted: httpx.AsyncClient,
                                                                        fake: FakeScheduler) -> None:
    alice = bearer("sk-alice")
    assert (await tenanted.post("/generate", json={"prompt": "Hi", "max_tokens": 2, "stream": False,
                                                   "model": "secret-ft"}, headers=alice)).status_code == 200
    response = await tenanted.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2,
                                                          "model": "secret-ft"}, headers=alice)
    assert response.status_code == 200 and response.json()["model"] == "secret-ft"
    assert [request.spec.lora_name for request in fake.requests] == ["secret-ft", "secret-ft"]


# -- a hostile tenant -----------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body"), DOORS)
async def test_a_tenant_probing_adapter_names_learns_nothing(tenanted: httpx.AsyncClient, fake: FakeScheduler,
                                                             path: str, body: dict[str, Any]) -> None:
    """The attack: bob names alice's adapter on each door, hoping its answer differs from a name
    that does not exist. Status, headers (bar the request id) and body are the same, bar the name."""
    bob = bearer("sk-bob")
    taken = await tenanted.post(path, json={**body, "model": "secret-ft"}, headers=bob)
    free = await tenanted.post(path, json={**body, "model": "secret-fu"}, headers=bob)
    assert taken.status_code == free.status_code == 404
    assert taken.json() == not_found("secret-ft") and free.json() == not_found("secret-fu")

    def headers(reply: httpx.Response) -> dict[str, str]:
        return {key: value for key, value in reply.headers.items() if key not in ("x-request-id", "content-length")}
    assert headers(taken) == headers(free)
    assert fake.requests == []
    listed = (await tenanted.get("/v1/models", headers=bob)).json()["data"]
    assert [card["id"] for card in listed] == list(NAMES)
    allowed = await tenanted.post(path, json={**body, "model": "secret-ft"}, headers=bearer("sk-alice"))
    assert allowed.status_code == 200, allowed.text


async def test_a_tenant_cannot_load_an_adapter_under_a_served_name(make_app: Callable[..., Any],
                                                                   fake: FakeScheduler, tmp_path: Path) -> None:
    write_adapter(tmp_path / "root" / "a")
    app = make_app(fake, served_model_names=NAMES, lora_root=str(tmp_path / "root"), lora_runtime_updates=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        reply = await http.post("/v1/load_lora_adapter", json={"lora_name": "org/alias", "lora_path": "a"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora_name"
        reply = await http.post("/v1/load_lora_adapter", json={"lora_name": "my-model", "lora_path": "a"})
        assert reply.status_code == 400 and "already served" in reply.json()["error"]["message"]


# -- /version -------------------------------------------------------------------------------------

async def test_version_answers_the_package_version(named: httpx.AsyncClient) -> None:
    reply = await named.get("/version")
    assert reply.status_code == 200 and reply.json() == {"version": package_version()}
    assert package_version() == "0.1.0"


async def test_version_is_behind_api_keys(tenanted: httpx.AsyncClient) -> None:
    assert (await tenanted.get("/version")).status_code == 401
    assert (await tenanted.get("/version", headers=bearer("sk-bob"))).status_code == 200


def test_without_the_package_the_version_is_pyprojects(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "version", missing)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "fairserve"\nversion = "9.8.7"\n')
    assert package_version(pyproject) == "9.8.7"
    assert package_version() == "0.1.0"         # the checkout's own pyproject.toml
    assert package_version(tmp_path / "absent.toml") == "0+unknown"
