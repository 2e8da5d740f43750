"""The simulated workers' prefix cache (benchmarks/sim_prefix_cache.py) through SimEngine: a
prompt that starts like a cached one skips those blocks' prefill and says so, the last prompt
token is always computed, other cache salts never share, eviction takes unheld blocks tail
first, and the events and snapshot are what a real worker publishes (chained block hashes)."""

from __future__ import annotations

import pytest

from benchmarks.sim_engine import SimEngine, StepCosts
from benchmarks.sim_prefix_cache import SimPrefixCache
from common.block_hash import ROOT_HASH, chain_hashes
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.types import REMOVED, STORED

BLOCK = 4
COSTS = StepCosts(decode_ms=20, decode_batch=8, prefill_tok_s=1000)


def prefill(engine: SimEngine, seq_id: str, prompt: list[int], salt: str = ""):
    """A prompt's whole prefill in one step: its result and the step's modelled seconds."""
    engine.pending_s = 0.0     # as the engine thread takes it after each step
    output = engine.step(StepBatch(new_sequences=(NewSequence(seq_id, tuple(prompt), cache_salt=salt),),
                                   work=(WorkItem(seq_id, len(prompt)),)))
    return output.results[0], engine.pending_s


def stored(events) -> list[tuple[int, tuple[int, ...]]]:
    return [(event.parent_hash, event.hashes) for event in events if event.kind == STORED]


def test_a_shared_prefix_is_served_from_the_cache_and_published_once() -> None:
    engine = SimEngine(COSTS, num_blocks=64, block_size=BLOCK)
    first, first_s = prefill(engine, "a", list(range(1, 11)))          # 10 tokens: 2 full blocks
    chain = chain_hashes(list(range(1, 11)), BLOCK)
    assert first.num_cached_tokens == 0 and first.sampled
    assert stored(engine.drain_events()) == [(ROOT_HASH, tuple(chain))]
    second, second_s = prefill(engine, "b", [*range(1, 9), 50, 51, 52])  # the same first 8 tokens
    assert second.num_cached_tokens == 8 and second.sampled and second.num_computed_tokens == 11
    assert second_s == pytest.approx(3 / 1000) and first_s == pytest.approx(10 / 1000)
    assert stored(engine.drain_events()) == []                         # its third block is not full yet
    assert engine.pool_stats().prefix_hit_tokens == 8 and engine.pool_stats().prefix_query_tokens == 21
    engine.cache.check_invariants()


def test_a_whole_cached_prompt_still_computes_its_last_token() -> None:
    engine = SimEngine(COSTS, num_blocks=64, block_size=BLOCK)
    prefill(engine, "a", list(range(1, 9)))                            # exactly 2 blocks
    again, seconds = prefill(engine, "b", list(range(1, 9)))
    assert again.num_cached_tokens == 4 and again.sampled                # the last block holds the last token
    assert seconds == pytest.approx(4 / 1000)


def test_another_cache_salt_never_shares_blocks() -> None:
    """A tenant with its own salt cannot probe another's prompts through cached tokens."""
    engine = SimEngine(COSTS, num_blocks=64, block_size=BLOCK)
    prefill(engine, "a", list(range(1, 11)), salt="tenant-a")
    other, _ = prefill(engine, "b", list(range(1, 11)), salt="tenant-b")
    same, _ = prefill(engine, "c", list(range(1, 11)), salt="tenant-a")
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 8


def test_eviction_takes_unheld_blocks_tail_first_and_publishes_it() -> None:
    cache = SimPrefixCache(BLOCK)
    old = chain_hashes(list(range(1, 13)), BLOCK)                      # 3 blocks
    held = chain_hashes(list(range(100, 108)), BLOCK)                  # 2 blocks, still running
    cache.store(old, 0)
    cache.release(old)
    cache.store(held, 0)
    cache.drain_events()
    cache.evict_to(1)                                                  # 5 cached, 2 held: 1 unheld may stay
    events = cache.drain_events()
    assert [(event.kind, event.hashes) for event in events] == [(REMOVED, (old[2], old[1]))]
    assert len(cache) == 3 and cache.held_blocks == 2 and cache.evictions == 2
    cache.check_invariants()
    assert sorted(cache.snapshot_chains()) == sorted([(ROOT_HASH, [old[0]]), (ROOT_HASH, [held[0]]),
                                                      (held[0], [held[1]])])


def test_freed_sequences_leave_their_blocks_cached_and_evictable() -> None:
    engine = SimEngine(COSTS, num_blocks=3, block_size=BLOCK)
    prefill(engine, "a", list(range(1, 10)))                           # 2 full blocks + 1 token: 3 used
    assert engine.pool_stats().used_blocks == 3 and engine.pool_stats().cached_blocks == 0
    engine.step(StepBatch(free_seq_ids=("a",)))
    engine.drain_events()
    assert engine.pool_stats().cached_blocks == 2 and engine.pool_stats().available_blocks == 3
    prefill(engine, "b", list(range(200, 209)))                        # needs all 3: the old ones go
    events = engine.drain_events()
    assert [event.kind for event in events] == [STORED, REMOVED]
    engine.cache.check_invariants()
