"""Lookups by tokens under a cache salt: they hash the prompt as the worker hashed that
salt's blocks, so they match that salt's prefixes only, on both backends and over gRPC."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from common.block_hash import prompt_hashes, salted_key
from services.kvcache.stores.backend import IndexBackend, MemoryBackend
from services.kvcache.client import KvIndexClient
from services.kvcache.kv_types import BlockStored, KvEvent, LookupResult, PublishBatch
from services.kvcache.stores.redis_backend import RedisBackend
from services.kvcache.server import build_server
from services.kvcache.service import KvIndexService

BLOCK = 4
MODEL_KEY = "tiny"
PROMPT = list(range(1, 15))   # three full blocks and two tokens
WORKER = "w"


def salted_chain(cache_salt: str, tokens: list[int] = PROMPT) -> BlockStored:
    """What a worker publishes for a whole prompt of a sequence with `cache_salt`."""
    hashes = prompt_hashes(tokens, BLOCK, salted_key(MODEL_KEY, cache_salt))
    return BlockStored(0, hashes.block_hashes, hashes.partial_hash)


async def publish(service: KvIndexService, *chains: BlockStored) -> None:
    await service.publish(PublishBatch(WORKER, full_resync=True))
    events = tuple(KvEvent(seq, chain) for seq, chain in enumerate(chains, start=1))
    assert not (await service.publish(PublishBatch(WORKER, events))).resync_needed


def matched(result: LookupResult) -> tuple[int, bool] | None:
    best = result.best
    return None if best is None else (best.matched_tokens, best.exact)


@pytest.fixture(params=["memory", "redis"])
async def service(request: pytest.FixtureRequest) -> AsyncIterator[KvIndexService]:
    if request.param == "memory":
        backend: IndexBackend = MemoryBackend(BLOCK)
    else:
        backend = RedisBackend.from_url(request.getfixturevalue("redis_url"), BLOCK)
    instance = KvIndexService(backend, MODEL_KEY)
    yield instance
    await instance.close()


async def test_a_salted_prompt_is_found_only_under_its_salt(service: KvIndexService) -> None:
    await publish(service, salted_chain("tenant-a"))
    assert matched(await service.lookup_tokens(PROMPT, "tenant-a")) == (len(PROMPT), True)
    assert matched(await service.lookup_tokens(PROMPT[:9], "tenant-a")) == (8, False)
    assert matched(await service.lookup_tokens(PROMPT, "tenant-b")) is None
    assert matched(await service.lookup_tokens(PROMPT)) is None


async def test_an_empty_salt_looks_up_as_before(service: KvIndexService) -> None:
    await publish(service, salted_chain(""), salted_chain("tenant-a", PROMPT[:3]))
    assert service.query_for_tokens(PROMPT) == service.query_for_tokens(PROMPT, "")
    hashes = prompt_hashes(PROMPT, BLOCK, MODEL_KEY)
    assert service.query_for_tokens(PROMPT).block_hashes == hashes.block_hashes
    assert matched(await service.lookup_tokens(PROMPT)) == (len(PROMPT), True)
    assert matched(await service.lookup_tokens(PROMPT, "tenant-a")) is None
    # A prompt shorter than a block hangs off the root for every salt, yet only its own matches.
    assert matched(await service.lookup_tokens(PROMPT[:3], "tenant-a")) == (3, True)
    assert matched(await service.lookup_tokens(PROMPT[:3])) is None


async def test_the_client_sends_the_salt_over_grpc() -> None:
    service = KvIndexService(MemoryBackend(BLOCK), MODEL_KEY)
    server = build_server(service, "127.0.0.1", 0)
    await server.start()
    client = KvIndexClient.connect(f"127.0.0.1:{server.port}")
    try:
        await publish(service, salted_chain("tenant-a"))
        assert matched(await client.lookup_tokens(PROMPT, cache_salt="tenant-a")) == (len(PROMPT), True)
        assert matched(await client.lookup_tokens(PROMPT, cache_salt="tenant-b")) is None
        assert matched(await client.lookup_tokens(PROMPT)) is None
    finally:
        await client.close()
        await server.stop(0)
