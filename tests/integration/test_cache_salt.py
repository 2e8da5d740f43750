"""Cache salts through the real processes (tiny model): requests sent to the scheduler with
different salts never share a cached prefix, whatever they ask; the same salt does, as
requests without a salt do among themselves, and the KV index answers per salt. Through the
gateway with API keys and the default scope, a tenant's guesses of another's prompt read
exactly what they would read without it, in flight too (test_isolation.py plays that attack);
PREFIX_CACHE_SCOPE=global shares, and PREFIX_CACHE_SCOPE=user keeps even one tenant's users apart."""

from __future__ import annotations

import random
from collections.abc import Iterator
from itertools import count
from pathlib import Path

import grpc
import httpx
import pytest
from fairserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

from fairserve.launcher.stack import Stack
from tests.integration.conftest import start_stack
from tests.integration.test_prefix_cache import BLOCK_SIZE, Probe, random_ids

_ids = count()


@pytest.fixture(scope="module")
def scheduler(tiny_stack: Stack) -> Iterator[scheduler_pb2_grpc.SchedulerStub]:
    with grpc.insecure_channel(f"127.0.0.1:{tiny_stack.ports.scheduler}") as channel:
        yield scheduler_pb2_grpc.SchedulerStub(channel)


@pytest.fixture(scope="module")
def probe(tiny_stack: Stack) -> Iterator[Probe]:
    probe = Probe(tiny_stack)
    yield probe
    probe.close()


def generate(scheduler: scheduler_pb2_grpc.SchedulerStub, prompt: list[int], salt: str,
             max_tokens: int = 3) -> tuple[list[int], int]:
    """(greedy tokens, cached prompt tokens) of one request with `salt`."""
    request = scheduler_pb2.GenerateRequest(
        request_id=f"salt-{next(_ids)}", prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=0.0), cache_salt=salt)
    events = list(scheduler.Generate(request, timeout=60))
    tokens = [token.token_id for event in events for token in event.tokens]
    return tokens, events[-1].finish.usage.cached_tokens


@pytest.mark.parametrize("length", [4 * BLOCK_SIZE + 2, BLOCK_SIZE - 1])
def test_another_salts_identical_prompt_reports_no_cached_tokens(
        scheduler: scheduler_pb2_grpc.SchedulerStub, probe: Probe, length: int) -> None:
    prompt = random_ids(random.Random(length), length)
    # One token each: the prompt's partial last block stays partial, published under its
    # salt's hash of the whole prompt, so the index's exact matches show each salt's own.
    cold, cached = generate(scheduler, prompt, "tenant-a", max_tokens=1)
    assert cached == 0
    probe.wait_quiescent()
    for salt in ("tenant-b", ""):
        tokens, cached = generate(scheduler, prompt, salt, max_tokens=1)
        assert cached == 0, f"salt {salt!r} must not see tenant-a's prefix"
        assert tokens == cold, "greedy tokens must not depend on the salt"
        probe.wait_quiescent()
    # Tenant A's repeat reuses every prompt token (the kept logits included).
    tokens, cached = generate(scheduler, prompt, "tenant-a", max_tokens=1)
    assert (tokens, cached) == (cold, len(prompt))
    probe.wait_quiescent()
    for salt in ("tenant-a", "tenant-b", ""):
        assert probe.exact_holders(prompt, salt) == {"worker-0"}, salt
    assert probe.exact_holders(prompt, "tenant-c") == set()


def test_a_salt_shares_the_prefix_of_its_own_prompts_only(scheduler: scheduler_pb2_grpc.SchedulerStub,
                                                          probe: Probe) -> None:
    rng = random.Random(7)
    system = random_ids(rng, 8 * BLOCK_SIZE)
    generate(scheduler, system + random_ids(rng, 5), "tenant-a")
    probe.wait_quiescent()
    assert generate(scheduler, system + random_ids(rng, 5), "tenant-b")[1] == 0
    probe.wait_quiescent()
    assert generate(scheduler, system + random_ids(rng, 5), "tenant-a")[1] == len(system)
    probe.wait_quiescent()


# ---- through the gateway: with API keys each tenant's cache is its own by default ----

KEYS = {name: f"sk-scope-{name}-0123456789abcdef" for name in ("alice", "bob", "carol")}
API_KEYS = ",".join(f"{name}={key}" for name, key in KEYS.items())


def complete(stack: Stack, tenant: str, prompt: list[int], **fields: str) -> tuple[str, int]:
    """(text, cached prompt tokens) of one greedy completion sent with `tenant`'s key."""
    reply = httpx.post(f"{stack.url}/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                       json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True, **fields})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def guesses_of(secret: list[int]) -> list[list[int]]:
    """The issue's attack: the secret itself, one wrong token in the middle, a wrong last one."""
    middle = len(secret) // 2
    return [list(secret), secret[:middle] + [secret[middle] + 1] + secret[middle + 1:],
            secret[:-1] + [secret[-1] + 1]]


# ---- PREFIX_CACHE_SCOPE=global with keys: the operator's opt-in to sharing ----

@pytest.fixture(scope="module")
def shared_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("shared"), tiny_model_dir, extra_env={
        "API_KEYS": API_KEYS, "PREFIX_CACHE_SCOPE": "global"})
    yield stack
    stack.stop()


def test_with_global_scope_tenants_share_cached_prefixes(shared_stack: Stack) -> None:
    prompt = random_ids(random.Random(7), 3 * BLOCK_SIZE + 5)
    text, cached = complete(shared_stack, "alice", prompt)
    assert cached == 0
    other_text, other_cached = complete(shared_stack, "bob", prompt)
    assert (other_text, other_cached) == (text, len(prompt)), "the opt-in shares as before"


# ---- PREFIX_CACHE_SCOPE=user: not even two users of one tenant share ----

@pytest.fixture(scope="module")
def per_user_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("per-user"), tiny_model_dir, extra_env={
        "API_KEYS": API_KEYS, "PREFIX_CACHE_SCOPE": "user"})
    yield stack
    stack.stop()


def test_with_user_scope_users_of_one_tenant_share_nothing(per_user_stack: Stack) -> None:
    prompt = random_ids(random.Random(40), 5 * BLOCK_SIZE + 2)
    text, cached = complete(per_user_stack, "alice", prompt, user="u1")
    assert cached == 0
    assert complete(per_user_stack, "alice", prompt, user="u2") == (text, 0)
    assert complete(per_user_stack, "alice", prompt, session_id="u1-session") == (text, 0)
    assert complete(per_user_stack, "bob", prompt, user="u1") == (text, 0)
    assert complete(per_user_stack, "alice", prompt, user="u1") == (text, len(prompt))
