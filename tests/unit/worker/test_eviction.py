"""Eviction policies on their own: order, skipped (held) blocks, reuse counts, aging."""

from __future__ import annotations

import pytest

from services.worker.engine.kv.eviction import LfuEviction, LruEviction, make_eviction_policy


def test_lru_evicts_the_least_recently_released_and_skips_held_blocks() -> None:
    policy = LruEviction()
    for block in (3, 1, 2):
        policy.add(block)
    policy.record_reuse(2)                  # ignored
    assert policy.victim(skip=set()) == 3
    assert policy.victim(skip={3}) == 1
    policy.remove(3)
    policy.add(3)                           # released again: now the newest
    assert list(policy) == [1, 2, 3] and len(policy) == 3 and 2 in policy


def test_lfu_evicts_the_fewest_reused_then_the_oldest() -> None:
    policy = LfuEviction(halve_every=100)
    for _ in range(3):
        policy.record_reuse(7)
    policy.record_reuse(5)
    for block in (7, 5, 1, 2):
        policy.add(block)
    assert list(policy) == [1, 2, 5, 7]
    assert policy.victim(skip=set()) == 1
    assert policy.victim(skip={1, 2}) == 5
    policy.remove(1)
    policy.remove(2)
    policy.remove(5)
    assert list(policy) == [7] and 5 not in policy and policy.reuses(5) == 1
    policy.forget(7)                        # its prefix is gone: the count goes with it
    policy.remove(7)
    policy.add(7)
    assert policy.reuses(7) == 0


def test_lfu_halves_the_counts_every_so_many_evictions() -> None:
    policy = LfuEviction(halve_every=2)
    for _ in range(5):
        policy.record_reuse(9)             # 5 -> 2 after one halving
    policy.record_reuse(8)                 # 1 -> 0
    for block in (9, 8, 4):
        policy.add(block)
    assert policy.victim(skip=set()) == 4  # first eviction
    policy.remove(4)
    assert policy.victim(skip=set()) == 8  # second eviction: counts halve
    assert (policy.reuses(9), policy.reuses(8)) == (2, 0)
    assert list(policy) == [8, 9]


def test_nothing_to_evict_raises_and_unknown_names_are_refused() -> None:
    policy = LfuEviction(halve_every=4)
    policy.add(1)
    with pytest.raises(StopIteration):
        policy.victim(skip={1})
    assert isinstance(make_eviction_policy("lru", 8), LruEviction)
    with pytest.raises(ValueError, match="lru, lfu"):
        make_eviction_policy("fifo", 8)
    with pytest.raises(ValueError):
        LfuEviction(halve_every=0)
