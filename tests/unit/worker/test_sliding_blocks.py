"""SlidingBlocks (sliding_blocks.py): which pool blocks hold a copy in the sliding layers'
cache; the states, reclaiming, protection and the reusable-prefix rule, then random
operations against the invariants."""

from __future__ import annotations

import random

import pytest

from services.worker.engine.kv.block_pool import BlockPool
from services.worker.engine.kv.sliding_blocks import NULL_BLOCK, SlidingBlocks

BLOCK = 4
WINDOW = 8


def test_first_in_window_is_the_first_entry_a_query_attends_to() -> None:
    sliding = SlidingBlocks(8, BLOCK, WINDOW)
    # A query at 11 sees positions 4..11: entries 1 and 2.
    assert [sliding.first_in_window(p) for p in (0, 7, 8, 11, 12, 100)] == [0, 0, 0, 1, 1, 23]


def test_cover_pins_attaches_and_leaves_what_it_stops_covering_idle() -> None:
    sliding = SlidingBlocks(4, BLOCK, WINDOW)
    assert sliding.cover("a", [10, 11, 12])
    assert [sliding.attached(b) for b in (10, 11, 12)] == [True] * 3 and sliding.num_free == 1
    assert sliding.cover("a", [11, 12, 13])
    assert sliding.num_idle == 1 and sliding.num_free == 0
    assert sliding.table([10, 11, 12, 13], 1)[0] == NULL_BLOCK
    # A fifth block reclaims the idle one (block 10's copy).
    assert sliding.cover("b", [20])
    assert not sliding.attached(10) and sliding.reclaimed == 1
    sliding.check_invariants({"a": [10, 11, 12, 13], "b": [20]})


def test_cover_changes_nothing_when_there_are_not_enough_blocks() -> None:
    sliding = SlidingBlocks(3, BLOCK, WINDOW)
    assert sliding.cover("a", [1, 2])
    assert not sliding.can_cover([5, 6], 0)
    assert not sliding.cover("b", [5, 6])
    assert not sliding.attached(5) and sliding.num_free == 1
    assert sliding.can_cover([5], 0)
    sliding.check_invariants()


def test_protected_idle_blocks_are_not_reclaimed() -> None:
    sliding = SlidingBlocks(2, BLOCK, WINDOW)
    sliding.cover("a", [1, 2])
    sliding.table_changed("a", ())      # both idle now, block 1 the older
    assert sliding.can_cover([3], 0, protect=[1]) and not sliding.can_cover([3, 4], 0, protect=[1])
    assert sliding.cover("b", [3], protect=[1])
    assert sliding.attached(1) and not sliding.attached(2)


def test_a_reused_pool_block_loses_its_copy_and_its_pins() -> None:
    sliding = SlidingBlocks(4, BLOCK, WINDOW)
    sliding.cover("a", [1, 2])
    sliding.block_reused(2)
    assert not sliding.attached(2) and sliding.num_free == 3
    sliding.check_invariants({"a": [1]})


def test_a_prefix_is_usable_up_to_where_its_window_is_attached() -> None:
    sliding = SlidingBlocks(16, BLOCK, WINDOW)
    blocks = [30, 31, 32, 33, 34, 35]
    sliding.cover("a", blocks)
    sliding.table_changed("a", ())
    assert sliding.usable_prefix(blocks) == 6
    # Losing block 34's copy (entry 4): prefixes of 6 and 5 blocks need it (their next
    # query, at 24 or 20, sees positions 17.. or 13..); 4 blocks need entries 2..3 only.
    sliding.block_reused(34)
    assert sliding.usable_prefix(blocks) == 4
    sliding.block_reused(30)          # entry 0 is outside the window of a 4-block prefix
    assert sliding.usable_prefix(blocks) == 4
    sliding.block_reused(32)          # every shorter prefix needs entry 0 or entry 2
    assert sliding.usable_prefix(blocks) == 0
    assert sliding.usable_prefix([]) == 0


def test_invariant_checks_catch_a_broken_state() -> None:
    sliding = SlidingBlocks(4, BLOCK, WINDOW)
    sliding.cover("a", [1, 2])
    sliding._free.append(sliding.sliding_of(1))
    with pytest.raises(AssertionError):
        sliding.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_keep_the_invariants(seed: int) -> None:
    """Sequences grow, slide, shrink and end on a real pool with the sliding blocks as its
    listener; after every operation every window is attached and the invariants hold."""
    rng = random.Random(seed)
    pool = BlockPool(40, BLOCK, enable_prefix_caching=False)
    sliding = SlidingBlocks(12, BLOCK, WINDOW)
    pool.listener = sliding
    lengths: dict[str, int] = {}
    for _ in range(300):
        op = rng.random()
        seq_id = f"s{rng.randrange(5)}"
        if op < 0.7:
            grown = lengths.get(seq_id, 0) + rng.randint(1, 9)
            first = sliding.first_in_window(lengths.get(seq_id, 0))
            table = pool.table(seq_id)
            new = pool.blocks_for(grown) - len(table)
            if pool.can_allocate(seq_id, grown) and sliding.can_cover(table[first:], new):
                assert pool.allocate(seq_id, grown)
                assert sliding.cover(seq_id, pool.table(seq_id)[first:])
                lengths[seq_id] = grown
        elif op < 0.85 and lengths.get(seq_id):
            lengths[seq_id] = rng.randint(0, lengths[seq_id])
            pool.shrink(seq_id, lengths[seq_id])
        else:
            pool.free(seq_id)
            lengths.pop(seq_id, None)
        tables = {s: pool.table(s) for s in lengths}
        sliding.check_invariants(tables)
        pool.check_invariants()
