"""BlockPool bookkeeping: allocation, sharing, prefix cache, eviction order, events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.block_hash import ROOT_HASH, chain_hashes, partial_block_hash
from services.kvcache.radix_index import RadixIndex
from services.worker.engine.kv.block_pool import BlockPool, PartialBlock
from services.worker.engine.kv.pool_invariants import PoolInvariantError
from services.worker.engine.types import CLEARED, REMOVED, STORED, BlockEvent


def _fill(pool: BlockPool, seq_id: str, tokens: list[int]) -> list[int]:
    """Allocates `tokens` for seq_id and registers every full block, as the engine does after a forward."""
    hashes = chain_hashes(tokens, pool.block_size)
    cached = pool.find_cached_prefix(hashes)
    assert pool.allocate(seq_id, len(tokens), cached)
    pool.cache_full_blocks(seq_id, len(cached), hashes[len(cached):],
                           hashes[len(cached) - 1] if cached else ROOT_HASH, tokens)
    pool.check_invariants()
    return hashes


def _partial(tokens: list[int], block_size: int) -> PartialBlock:
    """The partly filled last block of a sequence that computed exactly `tokens`."""
    full = len(tokens) // block_size
    parent = chain_hashes(tokens, block_size)[full - 1] if full else ROOT_HASH
    return PartialBlock(full, tuple(tokens[full * block_size:]), parent)


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
    pool.cache_full_blocks("b", 0, other, ROOT_HASH, [1, 2, 7, 7])
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


def test_freed_partial_block_stays_cached_and_is_found_by_its_tail() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = _fill(pool, "a", tokens)
    full_block, partial_block = pool.table("a")
    pool.drain_events()
    pool.free("a", _partial(tokens, 4))
    pool.check_invariants()
    assert pool.drain_events() == []          # partial entries are never published
    stats = pool.stats()
    # The partial block counts as free: the KV index knows exactly the cached blocks.
    assert (stats.used_blocks, stats.cached_blocks, stats.free_blocks) == (0, 1, 7)
    assert pool.find_cached_tail(hashes[0], [5]) == partial_block
    assert pool.find_cached_tail(hashes[0], [5, 6]) == partial_block
    assert pool.find_cached_tail(hashes[0], [5, 6, 7]) is None
    assert pool.find_cached_tail(hashes[0], [6]) is None
    assert pool.find_cached_tail(ROOT_HASH, [5, 6]) is None
    assert pool.find_cached_tail(ROOT_HASH, [1, 2, 3]) == full_block     # full blocks hold their tokens
    assert pool.find_cached_tail(ROOT_HASH, []) is None
    # A partial block is never reused as a prefix block.
    assert pool.find_cached_prefix(chain_hashes(tokens + [7, 8], 4)) == [full_block]


def test_partial_block_is_not_kept_when_shared_covered_or_disabled() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    _fill(pool, "a", [1, 2, 3, 4, 5, 6, 7])
    _fill(pool, "b", [1, 2, 3, 4, 5, 6])
    pool.free("a", _partial([1, 2, 3, 4, 5, 6, 7], 4))
    pool.free("b", _partial([1, 2, 3, 4, 5, 6], 4))    # a's entry already covers [5, 6]
    pool.check_invariants()
    assert pool.stats().free_blocks == 8 - 1
    assert pool.stats().cached_blocks == 1

    assert pool.allocate("c", 2)
    assert pool.allocate("d", 2, pool.table("c"))      # the block is shared
    pool.free("c", _partial([9, 9], 4))
    pool.free("d")
    assert pool.find_cached_tail(ROOT_HASH, [9]) is None

    disabled = BlockPool(num_blocks=4, block_size=4, enable_prefix_caching=False)
    assert disabled.allocate("a", 2)
    disabled.free("a", _partial([9, 9], 4))
    assert disabled.find_cached_tail(ROOT_HASH, [9]) is None
    assert disabled.stats().free_blocks == 4
    disabled.check_invariants()


def test_partial_blocks_are_evicted_before_their_parent_and_counted() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = _fill(pool, "a", tokens)
    pool.drain_events()
    pool.free("a", _partial(tokens, 4))
    assert pool.allocate("b", 8)                 # one free block, then the oldest cached: the partial
    assert pool.find_cached_tail(hashes[0], [5, 6]) is None
    assert pool.find_cached_prefix(hashes) == pool.find_cached_prefix(hashes[:1]) != []
    assert pool.stats().evictions == 1
    assert pool.drain_events() == []             # nothing published, nothing to remove
    pool.check_invariants()


def test_held_block_survives_allocation_and_keeps_its_state() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    tokens = [1, 2, 3]
    hashes = _fill(pool, "a", tokens)
    pool.free("a", _partial(tokens, 2))
    partial_block = pool.find_cached_tail(hashes[0], [3])
    assert partial_block is not None
    before = pool.stats()
    pool.hold(partial_block)
    pool.hold(partial_block)
    assert pool.stats() == before
    assert pool.num_allocatable() == 1
    pool.check_invariants()
    assert pool.allocate("b", 2)                 # evicts the full block, older-held partial stays
    assert pool.find_cached_tail(hashes[0], [3]) == partial_block
    assert not pool.allocate("c", 2)
    pool.release(partial_block)
    assert not pool.can_allocate("c", 2)         # still held once
    pool.release(partial_block)
    assert pool.allocate("c", 2)
    assert pool.find_cached_tail(hashes[0], [3]) is None
    pool.check_invariants()


def test_clear_cache_forgets_partial_entries() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    tokens = [1, 2, 3, 4, 5]
    hashes = _fill(pool, "a", tokens)
    pool.free("a", _partial(tokens, 4))
    pool.clear_cache()
    assert pool.find_cached_tail(hashes[0], [5]) is None
    assert pool.find_cached_tail(ROOT_HASH, [1]) is None
    assert pool.stats().free_blocks == 4
    pool.check_invariants()


def test_invariant_checker_catches_corruption() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.allocate("a", 4)
    pool._state.refcount[pool.table("a")[0]] = 2
    with pytest.raises(PoolInvariantError):
        pool.check_invariants()


def test_invariant_checker_catches_a_stale_tail_entry() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    _fill(pool, "a", [1, 2, 3])
    pool.free("a", _partial([1, 2, 3], 2))
    partial_block = pool.find_cached_tail(chain_hashes([1, 2], 2)[0], [3])
    assert partial_block is not None
    pool._state.block_tokens[partial_block] = None
    with pytest.raises(PoolInvariantError):
        pool.check_invariants()


_operations = st.lists(
    st.tuples(st.sampled_from(["grow", "free", "share", "tail"]), st.integers(0, 5), st.integers(1, 24),
              st.integers(0, 3)),
    min_size=1, max_size=60)


def _churn_tokens(variant: int, amount: int) -> list[int]:
    """Short prompts from few variants, so that prefixes and tails get reused."""
    return [variant % 2] * 4 + [variant] * (amount % 9 + 1)


@settings(max_examples=150, deadline=None)
@given(_operations, st.sampled_from(["lru", "lfu"]))
def test_random_churn_keeps_invariants(operations: list[tuple[str, int, int, int]], policy: str) -> None:
    pool = BlockPool(num_blocks=12, block_size=4, eviction_policy=policy)
    index = RadixIndex()
    live: dict[str, list[int]] = {}     # every allocated sequence's tokens
    freed: list[list[int]] = []
    for verb, seq_index, amount, variant in operations:
        seq_id = f"s{seq_index}"
        if verb == "free":
            if seq_id in live:
                freed.append(live[seq_id])
            _free_keeping_partial(pool, seq_id, live)
        elif verb == "tail" and seq_id not in live and freed:
            # A prompt that is a prefix of what an earlier sequence computed.
            earlier = freed[variant % len(freed)]
            _hold_a_tail_across_allocation(pool, seq_id, earlier[:amount % len(earlier) + 1], live)
        elif verb == "share" and seq_id not in live:
            tokens = _churn_tokens(variant, amount)
            hashes = chain_hashes(tokens, 4)
            cached = pool.find_cached_prefix(hashes[:(len(tokens) - 1) // 4])
            stats_before = pool.stats()
            if pool.allocate(seq_id, len(tokens), cached):
                live[seq_id] = tokens
                start = len(cached)
                pool.cache_full_blocks(seq_id, start, hashes[start:], hashes[start - 1] if start else ROOT_HASH,
                                       tokens)
            else:
                assert pool.stats() == stats_before
        else:
            tokens = live.get(seq_id, []) + [variant] * (amount % 12 + 1)
            if pool.allocate(seq_id, len(tokens)):
                live[seq_id] = tokens
        pool.check_invariants()
        _replay(index, pool)
    for seq_id in list(live):
        _free_keeping_partial(pool, seq_id, live)
    pool.check_invariants()
    _replay(index, pool)
    assert pool.stats().used_blocks == 0


def _replay(index: RadixIndex, pool: BlockPool) -> None:
    """Applies the pool's events to an index, which must then hold what a resync would send."""
    for event in pool.drain_events():
        assert event.kind in (STORED, REMOVED)
        if event.kind == STORED:
            index.insert("w", event.parent_hash, event.hashes, event.partial_hash)
        else:
            index.remove("w", event.hashes)
    assert index.blocks_of("w") == {value for _parent, chain in pool.cached_chains() for value in chain}
    assert index.partials_of("w") == {alias for _parent, alias in pool.cached_partials()}


def _free_keeping_partial(pool: BlockPool, seq_id: str, live: dict[str, list[int]]) -> None:
    """Frees keeping the partial block, aliased as if the prompt ended after its first
    token: tails starting alike share an alias."""
    tokens = live.pop(seq_id, [])
    partial = _partial(tokens, 4) if len(tokens) % 4 else None
    if partial is not None:
        alias = partial_block_hash(partial.parent_hash, partial.tokens[:1])
        partial = PartialBlock(partial.block_index, partial.tokens, partial.parent_hash, alias)
    pool.free(seq_id, partial)


def _hold_a_tail_across_allocation(pool: BlockPool, seq_id: str, tokens: list[int],
                                   live: dict[str, list[int]]) -> None:
    """The engine's exact-match path: the block found for the tail survives the allocation."""
    hashes = chain_hashes(tokens, 4)
    full = (len(tokens) - 1) // 4
    cached = pool.find_cached_prefix(hashes[:full])
    if len(cached) < full:
        return
    parent = hashes[full - 1] if full else ROOT_HASH
    source = pool.find_cached_tail(parent, tokens[full * 4:])
    if source is None:
        return
    pool.hold(source)
    if pool.allocate(seq_id, len(tokens), cached):
        live[seq_id] = tokens
        assert source not in pool.table(seq_id)
    assert pool.find_cached_tail(parent, tokens[full * 4:]) == source
    pool.release(source)


def test_longest_tail_finds_the_longest_shared_run() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    assert pool.allocate("a", 7)
    hashes = chain_hashes([1, 2, 3, 4, 5, 6, 7], 4)
    pool.cache_full_blocks("a", 0, hashes, ROOT_HASH, [1, 2, 3, 4, 5, 6, 7])
    assert pool.find_longest_tail(ROOT_HASH, [1, 2, 9, 9]) == (pool.table("a")[0], 2)
    assert pool.find_longest_tail(ROOT_HASH, [1, 2, 3, 4]) == (pool.table("a")[0], 4)
    assert pool.find_longest_tail(ROOT_HASH, [7]) is None
    pool.check_invariants()


# ---- partial aliases: a whole prompt's partial last block, published to the index ------------

def _aliased(tokens: list[int], alias: int, block_size: int = 4) -> PartialBlock:
    partial = _partial(tokens, block_size)
    return PartialBlock(partial.block_index, partial.tokens, partial.parent_hash, alias)


def test_kept_partial_with_an_alias_is_published_once() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = _fill(pool, "a", tokens)
    pool.drain_events()
    pool.free("a", _aliased(tokens, 777))
    pool.check_invariants()
    assert pool.drain_events() == [BlockEvent.stored([], hashes[0], partial_hash=777)]
    assert pool.cached_partials() == [(hashes[0], 777)]
    # The alias does not change what counts as cached: the index counts full blocks.
    stats = pool.stats()
    assert (stats.used_blocks, stats.cached_blocks, stats.free_blocks) == (0, 1, 7)


def test_partial_without_alias_or_not_kept_publishes_nothing() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    _fill(pool, "a", [1, 2, 3, 4, 5, 6, 7])
    _fill(pool, "b", [1, 2, 3, 4, 5, 6])
    pool.drain_events()
    pool.free("a", _partial([1, 2, 3, 4, 5, 6, 7], 4))
    pool.free("b", _aliased([1, 2, 3, 4, 5, 6], 55))    # covered by a's entry: not kept
    assert pool.drain_events() == []
    assert pool.cached_partials() == []
    pool.check_invariants()


def test_alias_at_the_root_is_published_under_the_root() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    assert pool.allocate("a", 3)
    pool.free("a", _aliased([1, 2, 3], 9))
    assert pool.drain_events() == [BlockEvent.stored([], ROOT_HASH, partial_hash=9)]
    assert pool.cached_partials() == [(ROOT_HASH, 9)]
    pool.check_invariants()


def test_two_partials_with_one_alias_publish_once_and_are_removed_after_both() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    # One prompt [1, 2, 3, 4, 5], continued two ways: both tails are kept, one alias.
    first, second = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 8]
    hashes = _fill(pool, "a", first)
    assert pool.allocate("b", len(second), pool.find_cached_prefix(hashes[:1]))
    pool.drain_events()
    pool.free("a", _aliased(first, 42))
    pool.free("b", _aliased(second, 42))
    pool.check_invariants()
    assert pool.drain_events() == [BlockEvent.stored([], hashes[0], partial_hash=42)]
    assert pool.cached_partials() == [(hashes[0], 42)]
    assert pool.stats().cached_blocks == 1

    assert pool.allocate("c", 4)          # one free block: nothing evicted
    assert pool.drain_events() == []
    assert pool.allocate("d", 4)          # evicts a's partial, b's still carries the alias
    assert pool.drain_events() == []
    assert pool.cached_partials() == [(hashes[0], 42)]
    pool.check_invariants()
    assert pool.allocate("e", 4)          # evicts b's partial: the alias goes
    assert pool.drain_events() == [BlockEvent.removed([42])]
    assert pool.cached_partials() == []
    assert pool.find_cached_prefix(hashes) == pool.find_cached_prefix(hashes[:1]) != []
    assert pool.stats().evictions == 2
    pool.check_invariants()


def test_alias_is_withdrawn_with_its_parent_hash() -> None:
    """A held partial can outlive its parent block; the index only keeps partials
    under a parent the worker holds, so the alias goes with the parent."""
    pool = BlockPool(num_blocks=2, block_size=2)
    tokens = [1, 2, 3]
    hashes = _fill(pool, "a", tokens)
    pool.drain_events()
    pool.free("a", _aliased(tokens, 31, block_size=2))
    assert pool.drain_events() == [BlockEvent.stored([], hashes[0], partial_hash=31)]
    partial_block = pool.find_cached_tail(hashes[0], [3])
    assert partial_block is not None
    pool.hold(partial_block)
    assert pool.allocate("b", 2)          # evicts the parent, the held partial stays
    assert pool.drain_events() == [BlockEvent.removed([hashes[0], 31])]
    assert pool.cached_partials() == []
    assert pool.find_cached_tail(hashes[0], [3]) == partial_block
    pool.check_invariants()
    pool.release(partial_block)
    assert pool.allocate("c", 2)          # the entry goes too, nothing more to withdraw
    assert pool.drain_events() == []
    pool.check_invariants()


def test_alias_under_an_unregistered_parent_is_not_published() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    assert pool.allocate("a", 6)          # no full block registered
    pool.free("a", PartialBlock(1, (5, 6), 123456, 77))
    assert pool.find_cached_tail(123456, [5, 6]) is not None   # kept, but not published
    assert pool.drain_events() == [] and pool.cached_partials() == []
    pool.check_invariants()


def test_clear_cache_drops_aliases_without_removals() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    tokens = [1, 2, 3, 4, 5]
    _fill(pool, "a", tokens)
    pool.free("a", _aliased(tokens, 11))
    pool.drain_events()
    pool.clear_cache()
    assert [event.kind for event in pool.drain_events()] == [CLEARED]
    assert pool.cached_partials() == []
    pool.check_invariants()
    # Published afresh after the clear.
    _fill(pool, "b", tokens)
    pool.free("b", _aliased(tokens, 11))
    assert [event.partial_hash for event in pool.drain_events() if event.kind == STORED] == [0, 11]
    pool.check_invariants()


def test_invariant_checker_catches_a_stale_alias() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    tokens = [1, 2, 3, 4, 5]
    _fill(pool, "a", tokens)
    pool.free("a", _aliased(tokens, 11))
    pool.check_invariants()
    (block,) = pool._state.aliases.blocks[11]
    pool._state.aliases.of[block] = 12
    with pytest.raises(PoolInvariantError):
        pool.check_invariants()


def _hot_prefix_hits(policy: str) -> list[int]:
    """A shared 8-block system prompt, one request per turn, with one-off 6-block prompts
    between turns: 2 per turn at first (they fit beside it), then 6 (more than the pool
    holds). Returns the prompt tokens each turn found in the cache."""
    pool = BlockPool(num_blocks=32, block_size=4, eviction_policy=policy)
    system = list(range(1000, 1032))
    hits = []
    for turn in range(12):
        tokens = system + [turn, turn + 1]
        hashes = chain_hashes(tokens, 4)
        cached = pool.find_cached_prefix(hashes[:len(tokens) // 4])
        hits.append(len(cached) * 4)
        assert pool.allocate(f"hot{turn}", len(tokens), cached)
        pool.cache_full_blocks(f"hot{turn}", len(cached), hashes[len(cached):],
                               hashes[len(cached) - 1] if cached else ROOT_HASH, tokens)
        pool.free(f"hot{turn}")
        for one_off in range(2 if turn < 3 else 6):
            _fill(pool, f"scan{turn}-{one_off}", [turn * 100 + one_off * 10 + 5000 + i for i in range(24)])
            pool.free(f"scan{turn}-{one_off}")
        pool.check_invariants()
    return hits


def test_lfu_keeps_a_reused_prefix_through_floods_of_one_off_prompts() -> None:
    assert _hot_prefix_hits("lru") == [0, 32, 32, 32] + [0] * 8    # each big flood pushed it out
    assert _hot_prefix_hits("lfu") == [0] + [32] * 11


def test_drop_takes_blocks_out_of_the_middle_of_a_table() -> None:
    pool = BlockPool(8, 4, enable_prefix_caching=False)
    assert pool.allocate("s", 20)
    table = list(pool.table("s"))
    pool.drop("s", [1, 2])
    assert pool.table("s") == [table[0], table[3], table[4]]
    assert pool.stats().free_blocks == 8 - 3
    pool.check_invariants()
