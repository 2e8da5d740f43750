"""BlockPool bookkeeping: allocation, sharing, prefix cache, eviction order, events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.block_hash import ROOT_HASH, chain_hashes
from services.worker.engine.block_pool import BlockPool, PoolInvariantError
from services.worker.engine.types import CLEARED, REMOVED, STORED, BlockEvent


def _fill(pool: BlockPool, seq_id: str, tokens: list[int]) -> list[int]:
    """Allocates `tokens` for seq_id and registers every full block, as the engine does after a forward."""
    hashes = chain_hashes(tokens, pool.block_size)
    cached = pool.find_cached_prefix(hashes)
    assert pool.allocate(seq_id, len(tokens), cached)
    pool.cache_full_blocks(seq_id, len(cached), hashes[len(cached):],
                           hashes[len(cached) - 1] if cached else ROOT_HASH)
    pool.check_invariants()
    return hashes


def test_allocate_grows_table_and_free_returns_blocks() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    assert pool.allocate("a", 5)
    assert len(pool.table("a")) == 2
    assert pool.allocate("a", 8)              # still fits in two blocks
    assert len(pool.table("a")) == 2
    assert pool.allocate("a", 9)
    assert len(pool.table("a")) == 3
    assert pool.stats().used_blocks == 3
    pool.free("a")
    assert pool.stats().free_blocks == 8
    pool.check_invariants()


def test_allocation_that_cannot_be_met_changes_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    assert pool.allocate("a", 12)
    before = (pool.stats(), list(pool.table("a")))
    assert not pool.can_allocate("b", 8)
    assert not pool.allocate("b", 8)
    assert not pool.allocate("a", 17)
    assert (pool.stats(), list(pool.table("a"))) == before
    assert not pool.has_sequence("b")
    assert pool.allocate("b", 4)
    pool.check_invariants()


def test_shared_prefix_blocks_are_reference_counted() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    hashes = _fill(pool, "a", list(range(8)))
    cached = pool.find_cached_prefix(hashes)
    assert cached == pool.table("a")
    assert pool.allocate("b", 10, cached)
    assert pool.table("b")[:2] == pool.table("a")
    assert pool.stats().used_blocks == 3
    pool.free("a")
    assert pool.stats().used_blocks == 3     # b still holds the shared blocks
    pool.free("b")
    stats = pool.stats()
    assert (stats.used_blocks, stats.cached_blocks, stats.free_blocks) == (0, 2, 6)
    pool.check_invariants()


def test_freed_blocks_stay_cached_and_are_reused() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    hashes = _fill(pool, "a", list(range(12)))
    blocks = list(pool.table("a"))
    pool.free("a")
    assert pool.find_cached_prefix(hashes) == blocks
    assert pool.find_cached_prefix(chain_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)) == blocks[:1]


def test_eviction_takes_leaves_before_parents_and_never_referenced_blocks() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    hashes = _fill(pool, "a", [1, 2, 3, 4, 5, 6])   # three blocks: root -> h1 -> h2
    pool.drain_events()
    pool.free("a")
    assert pool.allocate("b", 4)          # one free block + evicts one cached block
    events = pool.drain_events()
    assert events == [BlockEvent.removed([hashes[2]])]
    assert pool.find_cached_prefix(hashes) == pool.find_cached_prefix(hashes[:2])
    assert len(pool.find_cached_prefix(hashes)) == 2
    cached = pool.find_cached_prefix(hashes[:1])
    assert pool.allocate("c", 2, cached)  # c now references the root block
    assert pool.allocate("b", 6)          # needs one more: must evict h1, not the referenced root
    assert pool.drain_events() == [BlockEvent.removed([hashes[1]])]
    assert pool.find_cached_prefix(hashes) == cached
    assert not pool.allocate("d", 2)      # everything is referenced now
    pool.check_invariants()
    assert pool.stats().evictions == 2


def test_stored_events_follow_prefix_order_and_skip_duplicates() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    hashes = _fill(pool, "a", [1, 2, 3, 4])
    assert pool.drain_events() == [BlockEvent.stored(hashes, ROOT_HASH)]
    # b computes the same first block itself (no reuse), then a new one.
    assert pool.allocate("b", 4)
    other = chain_hashes([1, 2, 7, 7], 2)
    pool.cache_full_blocks("b", 0, other, ROOT_HASH)
    assert pool.drain_events() == [BlockEvent.stored([other[1]], other[0])]
    pool.free("b")
    assert pool.stats().free_blocks + pool.stats().cached_blocks + pool.stats().used_blocks == 8
    pool.check_invariants()


def test_cached_chains_cover_every_registered_block() -> None:
    pool = BlockPool(num_blocks=16, block_size=2)
    first = _fill(pool, "a", [1, 2, 3, 4, 5, 6])
    second = _fill(pool, "b", [1, 2, 3, 4, 9, 9, 8, 8])
    chains = pool.cached_chains()
    covered = {value for _parent, chain in chains for value in chain}
    assert covered == set(first) | set(second)
    for parent, chain in chains:
        assert parent == ROOT_HASH or parent in covered
    # The shared prefix ends where the two sequences fork.
    assert (ROOT_HASH, first[:2]) in chains
    assert (first[1], first[2:]) in chains
    assert (first[1], second[2:]) in chains


def test_clear_cache_forgets_hashes_and_emits_cleared() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    hashes = _fill(pool, "a", [1, 2, 3, 4])
    pool.free("a")
    pool.drain_events()
    pool.clear_cache()
    assert [event.kind for event in pool.drain_events()] == [CLEARED]
    assert pool.find_cached_prefix(hashes) == []
    assert pool.stats().free_blocks == 8
    pool.check_invariants()


def test_prefix_caching_disabled_never_matches() -> None:
    pool = BlockPool(num_blocks=8, block_size=2, enable_prefix_caching=False)
    hashes = _fill(pool, "a", [1, 2, 3, 4])
    pool.free("a")
    assert pool.find_cached_prefix(hashes) == []
    assert pool.stats().free_blocks == 8
    assert pool.drain_events() == []


def test_invariant_checker_catches_corruption() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.allocate("a", 4)
    pool._refcount[pool.table("a")[0]] = 2
    with pytest.raises(PoolInvariantError):
        pool.check_invariants()


_operations = st.lists(
    st.tuples(st.sampled_from(["grow", "free", "share"]), st.integers(0, 5), st.integers(1, 24),
              st.integers(0, 3)),
    min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(_operations)
def test_random_churn_keeps_invariants(operations: list[tuple[str, int, int, int]]) -> None:
    pool = BlockPool(num_blocks=12, block_size=4)
    lengths: dict[str, int] = {}
    for verb, seq_index, amount, variant in operations:
        seq_id = f"s{seq_index}"
        if verb == "free":
            pool.free(seq_id)
            lengths.pop(seq_id, None)
        elif verb == "share" and seq_id not in lengths:
            tokens = [variant % 2] * 8 + [variant] * amount
            hashes = chain_hashes(tokens, 4)
            cached = pool.find_cached_prefix(hashes[:(len(tokens) - 1) // 4])
            stats_before = pool.stats()
            if pool.allocate(seq_id, len(tokens), cached):
                lengths[seq_id] = len(tokens)
                start = len(cached)
                pool.cache_full_blocks(seq_id, start, hashes[start:], hashes[start - 1] if start else ROOT_HASH)
            else:
                assert pool.stats() == stats_before
        else:
            target = lengths.get(seq_id, 0) + amount
            if pool.allocate(seq_id, target):
                lengths[seq_id] = target
        pool.check_invariants()
        for event in pool.drain_events():
            assert event.kind in (STORED, REMOVED)
    for seq_id in list(lengths):
        pool.free(seq_id)
    pool.check_invariants()
    assert pool.stats().used_blocks == 0
