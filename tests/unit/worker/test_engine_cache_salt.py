"""Cache salts on the worker: sequences with different salts share no cached block (full,
a copied partial tail, or a kept last-position logits row) and report 0 cached tokens;
sequences with the same salt share as unsalted ones do, and an empty salt is unsalted."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.block_hash import ROOT_HASH, chain_hashes, prompt_hashes, salted_key
from common.types import SamplingParams
from services.kvcache.stores.backend import MemoryBackend
from services.kvcache.publisher import KvEventPublisher
from services.kvcache.service import KvIndexService
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.kv.block_pool import BlockPool, PartialBlock
from services.worker.kv_events import add_events, snapshot_source
from tests.unit.worker.engine_helpers import Driver, decode_and_free, generate, make_engine, prompt_of

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def kind() -> str:
    return "gemma3"


def _start(driver: Driver, seq_id: str, prompt: list[int], salt: str) -> tuple[int, int]:
    """(cached tokens, batch tokens) of a salted sequence's first step."""
    new = NewSequence(seq_id, tuple(prompt), (), SamplingParams(), cache_salt=salt)
    out = driver.step(StepBatch(new_sequences=(new,), work=(WorkItem(seq_id, 1024),)))
    (result,) = out.results
    assert result.sampled and result.num_computed_tokens == len(prompt)
    return result.num_cached_tokens, out.batch_tokens


def _run(driver: Driver, seq_id: str, prompt: list[int], salt: str, new_tokens: int = 3) -> tuple[int, list[int]]:
    """Runs a salted sequence to `new_tokens` outputs and frees it: (cached tokens, outputs)."""
    cached, _ = _start(driver, seq_id, prompt, salt)
    return cached, decode_and_free(driver, seq_id, new_tokens)


@pytest.mark.parametrize("prompt_len", [
    15,     # full blocks and a partial tail
    16,     # block-aligned
    3,      # no full block: a tail after the root, whatever the salt
])
def test_other_salts_share_nothing_and_the_same_salt_shares(kind: str, reference: torch.nn.Module,
                                                            prompt_len: int) -> None:
    engine = make_engine(kind, block_size=BLOCK_SIZE)
    driver = Driver(engine)
    prompt = prompt_of(prompt_len, prompt_len)
    expected = generate(reference, prompt, 3)
    cached, out = _run(driver, "a1", prompt, "tenant-a")
    assert (cached, out) == (0, expected[:len(out)])
    for seq_id, salt in (("b1", "tenant-b"), ("unsalted", "")):
        cached, batch_tokens = _start(driver, seq_id, prompt, salt)
        assert (cached, batch_tokens) == (0, prompt_len), salt
        assert decode_and_free(driver, seq_id, 3) == out
    # The same salt again: the whole prompt comes from the cache (blocks, tail and logits).
    assert _start(driver, "a2", prompt, "tenant-a") == (prompt_len, 0)
    assert decode_and_free(driver, "a2", 3) == out
    assert _start(driver, "b2", prompt, "tenant-b") == (prompt_len, 0)
    assert _start(driver, "plain", prompt, "") == (prompt_len, 0)


def test_running_sequences_of_two_salts_hold_no_block_in_common(kind: str) -> None:
    engine = make_engine(kind, block_size=BLOCK_SIZE)
    driver = Driver(engine)
    prompt = prompt_of(13, 5)
    driver.run({"a": prompt}, 1, free_at_end=False)           # unsalted, still running
    _start(driver, "b", prompt, "tenant-b")
    _start(driver, "b-again", prompt, "tenant-b")
    a, b, b_again = (set(engine.pool.table(seq_id)) for seq_id in ("a", "b", "b-again"))
    assert not a & b and not a & b_again
    assert len(b & b_again) == 3                              # the same salt shares its full blocks


def test_a_partial_run_is_copied_only_from_a_block_of_the_same_salt(kind: str) -> None:
    engine = make_engine(kind, block_size=BLOCK_SIZE, prompt_logits_cache_size=0)
    driver = Driver(engine)
    head = prompt_of(7, 9)
    _run(driver, "a", head, "tenant-a", 1)
    other = head[:3] + [head[3] + 1, 11]                      # shares 3 tokens of the first block
    assert _start(driver, "b", other, "tenant-b") == (0, len(other))
    assert _start(driver, "a-other", other, "tenant-a") == (3, len(other) - 3)


def test_kept_logits_are_not_served_across_salts(kind: str) -> None:
    engine = make_engine(kind, block_size=BLOCK_SIZE)
    driver = Driver(engine)
    prompt = prompt_of(3, 4)                                  # its logits key chains to the root
    _run(driver, "a", prompt, "tenant-a", 1)
    _start(driver, "b", prompt, "tenant-b")
    assert driver.steps[-1].prompt_logits_hits == 0
    assert engine.prompt_logits.hits == 0 and len(engine.prompt_logits) == 2
    _start(driver, "a-again", prompt, "tenant-a")
    assert (driver.steps[-1].prompt_logits_hits, engine.prompt_logits.hits) == (1, 1)


def test_salted_blocks_are_published_under_the_salts_hashes(kind: str) -> None:
    """The index, looking up by tokens with the same salt, sees exactly what the worker holds."""
    async def scenario() -> None:
        engine = make_engine(kind, block_size=BLOCK_SIZE)
        backend = MemoryBackend(BLOCK_SIZE)
        service = KvIndexService(backend, kind)

        async def cache() -> tuple[list[tuple[int, list[int]]], list[tuple[int, int]]]:
            return engine.snapshot_chains(), engine.snapshot_partials()

        publisher = KvEventPublisher("w", backend.publish, snapshot_source(cache))
        assert await publisher.flush()
        prompt = prompt_of(15, 7)
        _run(Driver(engine), "a", prompt, "tenant-a", 1)
        add_events(publisher, engine.drain_events())
        assert await publisher.flush()
        hashes = prompt_hashes(prompt, BLOCK_SIZE, salted_key(kind, "tenant-a"))
        assert engine.snapshot_partials() == [(hashes.block_hashes[-1], hashes.partial_hash)]
        best = (await service.lookup_tokens(prompt, "tenant-a")).best
        assert best is not None and (best.matched_tokens, best.exact) == (15, True)
        assert (await service.lookup_tokens(prompt, "tenant-b")).best is None
        assert (await service.lookup_tokens(prompt)).best is None
    asyncio.run(scenario())


def test_pool_tail_index_is_keyed_by_salt() -> None:
    """Full blocks and kept partial ones after the root: each salt finds only its own."""
    pool = BlockPool(num_blocks=8, block_size=4)
    full, short = [5, 6, 7, 8], [5, 6, 7]
    for salt in ("tenant-a", "tenant-b"):
        assert pool.allocate(f"full-{salt}", len(full))
        pool.cache_full_blocks(f"full-{salt}", 0, chain_hashes(full, 4, salted_key("m", salt)), ROOT_HASH, full, salt)
        assert pool.allocate(f"short-{salt}", len(short))
        pool.free(f"short-{salt}", PartialBlock(0, tuple(short), ROOT_HASH, cache_salt=salt))
        pool.check_invariants()
    for tokens in (full, short):
        found = {salt: pool.find_cached_tail(ROOT_HASH, tokens, salt) for salt in ("tenant-a", "tenant-b", "")}
        assert found["tenant-a"] is not None and found["tenant-b"] is not None and found[""] is None
        assert found["tenant-a"] != found["tenant-b"]


def test_guessing_anothers_prompt_token_by_token_reads_nothing(kind: str) -> None:
    """The attack of issue 38: bob sends guesses of alice's cached prompt and reads his own
    cached tokens (and computed tokens, which his latency follows). Under his own salt he
    reads exactly what he would read had alice never sent it; under a shared salt the counts
    give alice's prompt away to the token (the partial-block copy)."""
    secret = prompt_of(33, 21)
    guesses = [secret[:18] + [secret[18] + 1] + secret[19:],      # one wrong token in the middle
               secret[:-1] + [secret[-1] + 1],                     # a wrong last token
               secret]

    def bobs_reads(alice_first: bool, bob_salt: str) -> list[tuple[int, int]]:
        driver = Driver(make_engine(kind, block_size=BLOCK_SIZE, prompt_logits_cache_size=0))
        if alice_first:
            _run(driver, "alice", secret, "alice", 1)
        reads = []
        for index, guess in enumerate(guesses):
            reads.append(_start(driver, f"bob-{index}", guess, bob_salt))
            decode_and_free(driver, f"bob-{index}", 1)
        return reads

    isolated = bobs_reads(True, "bob")
    assert isolated == bobs_reads(False, "bob")
    assert isolated[0] == (0, len(secret))
    # What the salt closes: sharing alice's salt, the first guess reads her prompt to the token.
    assert bobs_reads(True, "alice")[0] == (18, len(secret) - 18)
