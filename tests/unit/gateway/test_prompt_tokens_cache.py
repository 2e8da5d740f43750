"""The gateway's cache of recent prompts' token ids (text/prompt_tokens_cache.py): its bound
and order, and through the app who may hit whose entries: a tenant only its own with keys (a
hostile tenant sending another's prompt is tokenized afresh, so its timing says nothing),
everyone without keys, nobody under the `user` scope or with the cache off."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from services.gateway.requests.prompt_bound import BoundedTokenizer
from services.gateway.tenancy.tenant_config import load_tenants
from services.gateway.text.prompt_tokens_cache import PromptTokensCache
from tests.unit.gateway.fakes import FakeScheduler

KEYS = "alice=sk-alice,bob=sk-bob"
PROMPT = "The quarterly figures for the northern region, in confidence: " * 8


def build(tokenizer: Any, text: str) -> list[int]:
    return [len(text)]


def test_a_hit_is_a_copy_and_the_most_recent() -> None:
    cache = PromptTokensCache(max_tokens=6)
    first, second = cache.key("", build, ("a",), None), cache.key("", build, ("b",), None)
    cache.put(first, [1, 2, 3])
    cache.put(second, [4, 5, 6])
    got = cache.get(first)
    assert got == [1, 2, 3]
    got.append(99)
    assert cache.get(first) == [1, 2, 3]
    cache.put(cache.key("", build, ("c",), None), [7])    # over the bound: b, the least recent, goes
    assert cache.get(second) is None and cache.get(first) == [1, 2, 3]
    assert (cache.hits, cache.misses) == (3, 1)
    cache.check_invariants()


def test_the_bound_holds_and_no_entry_passes_it() -> None:
    cache = PromptTokensCache(max_tokens=100)
    for index in range(50):
        cache.put(cache.key("", build, (str(index),), None), list(range(index % 7 + 1)))
        cache.check_invariants()
    assert cache.tokens <= 100
    too_long = cache.key("", build, ("long",), None)
    cache.put(too_long, list(range(101)))
    assert cache.get(too_long) is None
    cache.put(cache.key("", build, ("empty",), None), [])
    cache.check_invariants()


def test_keys_differ_by_salt_builder_arguments_and_bound() -> None:
    cache = PromptTokensCache()
    key = cache.key("tenant:alice", build, ("x",), (8192, 31, "prompt"))
    assert key == cache.key("tenant:alice", build, ("x",), (8192, 31, "prompt"))
    others = [cache.key("tenant:bob", build, ("x",), (8192, 31, "prompt")),
              cache.key("", build, ("x",), (8192, 31, "prompt")),
              cache.key("tenant:alice", test_keys_differ_by_salt_builder_arguments_and_bound, ("x",),
                        (8192, 31, "prompt")),
              cache.key("tenant:alice", build, ("x", False), (8192, 31, "prompt")),
              cache.key("tenant:alice", build, ("x",), (4096, 31, "prompt"))]
    assert len({key, *others}) == 6


def test_off_and_unsalted_requests_are_not_cached() -> None:
    assert PromptTokensCache(max_tokens=0).key("", build, ("x",), None) is None
    cache = PromptTokensCache()
    assert cache.key(None, build, ("x",), None) is None
    cache.put(None, [1])
    assert cache.get(None) is None and len(cache) == 0


@pytest.fixture
def encodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts the gateway really tokenized."""
    seen: list[str] = []
    original = BoundedTokenizer.__call__

    def counting(self: BoundedTokenizer, text: str, add_special_tokens: bool = True) -> Any:
        seen.append(text)
        return original(self, text, add_special_tokens)

    monkeypatch.setattr(BoundedTokenizer, "__call__", counting)
    return seen


async def complete(app: Any, key: str | None, prompt: str = PROMPT) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        reply = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=headers)
    assert reply.status_code == 200, reply.text
    return reply


async def test_a_tenant_hits_its_own_prompts_only(make_app: Callable[..., Any], fake: FakeScheduler,
                                                  encodes: list[str]) -> None:
    app = make_app(fake, tenants=load_tenants(KEYS))
    await complete(app, "sk-alice")
    await complete(app, "sk-alice")
    assert encodes == [PROMPT]                          # alice's second request was not tokenized
    assert fake.requests[0].spec.prompt_token_ids == fake.requests[1].spec.prompt_token_ids
    await complete(app, "sk-bob")                       # bob sends alice's prompt: tokenized afresh
    assert encodes == [PROMPT, PROMPT]
    assert fake.requests[2].spec.prompt_token_ids == fake.requests[0].spec.prompt_token_ids
    cache = app.state.gateway.prompt_tokens
    assert (cache.hits, len(cache)) == (1, 2)
    cache.check_invariants()
    lookups = app.state.gateway.metrics.prompt_tokens_cache
    assert (lookups["hit"]._value.get(), lookups["miss"]._value.get()) == (1, 2)


async def test_without_keys_everyone_shares(make_app: Callable[..., Any], fake: FakeScheduler,
                                            encodes: list[str]) -> None:
    app = make_app(fake)
    for _ in range(3):
        await complete(app, None)
    assert encodes == [PROMPT]
    await complete(app, None, PROMPT + " Another.")
    assert encodes == [PROMPT, PROMPT + " Another."]


@pytest.mark.parametrize("settings", [{"prompt_tokens_cache_tokens": 0},
                                      {"prefix_cache_scope": "user", "tenants": load_tenants(KEYS)}])
async def test_off_or_per_user_tokenizes_every_prompt(make_app: Callable[..., Any], fake: FakeScheduler,
                                                      encodes: list[str], settings: dict[str, Any]) -> None:
    app = make_app(fake, **settings)
    key = "sk-alice" if "tenants" in settings else None
    await complete(app, key)
    await complete(app, key)
    assert encodes == [PROMPT, PROMPT]
    assert len(app.state.gateway.prompt_tokens) == 0
