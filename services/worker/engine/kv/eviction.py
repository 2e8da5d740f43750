"""Which cached block to evict when the pool needs a block (EVICTION_POLICY).

The pool hands every block that becomes evictable (refcount 0, still holding a
prefix) to the policy, takes it back when a sequence reuses it, and asks for a
victim when it runs out of free blocks.

lru  Least recently released first. A sequence releases its blocks tail first,
     so a block always goes before the prefix it extends.
lfu  Fewest reuses first, least recently released among equals. A prefix
     that many requests share (a system prompt) outlives a flood of one-off
     prompts that would push it out of an LRU cache. A block is reused at least
     as often as any block extending it (a prefix match always starts at the
     root), so here too a block goes before the prefix it extends. Counts are
     halved every 8 x num_blocks evictions, so that a prefix that stopped being
     used loses its standing. A prefix is protected from its first reuse on: one
     that a flood evicts before anyone reuses it is lost as under lru.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterator
from typing import Protocol

EVICTION_POLICIES = ("lru", "lfu")
LFU_HALVING_PERIOD_IN_POOLS = 8     # lfu halves its counts after this many pools' worth of evictions


class EvictionPolicy(Protocol):
    def add(self, block: int) -> None: ...
    def remove(self, block: int) -> None: ...
    def victim(self, skip: Container[int]) -> int: ...
    def record_reuse(self, block: int) -> None: ...
    def forget(self, block: int) -> None: ...
    def clear(self) -> None: ...
    def __contains__(self, block: object) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[int]: ...


class LruEviction:
    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()   # oldest first

    def add(self, block: int) -> None:
        self._order[block] = None

    def remove(self, block: int) -> None:
        del self._order[block]

    def victim(self, skip: Container[int]) -> int:
        return next(block for block in self._order if block not in skip)

    def record_reuse(self, block: int) -> None:
        pass

    def forget(self, block: int) -> None:
        pass

    def clear(self) -> None:
        self._order.clear()

    def __contains__(self, block: object) -> bool:
        return block in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)


class LfuEviction:
    def __init__(self, halve_every: int) -> None:
        if halve_every <= 0:
            raise ValueError("halve_every must be positive")
        self._halve_every = halve_every
        self._reuses: dict[int, int] = {}                      # block -> reuses (absent: 0)
        self._buckets: dict[int, OrderedDict[int, None]] = {}  # reuses -> evictable blocks, oldest first
        self._bucket_of: dict[int, int] = {}                   # evictable block -> its bucket
        self._victims = 0

    def reuses(self, block: int) -> int:
        return self._reuses.get(block, 0)

    def add(self, block: int) -> None:
        count = self.reuses(block)
        self._buckets.setdefault(count, OrderedDict())[block] = None
        self._bucket_of[block] = count

    def remove(self, block: int) -> None:
        count = self._bucket_of.pop(block)
        bucket = self._buckets[count]
        del bucket[block]
        if not bucket:
            del self._buckets[count]

    def victim(self, skip: Container[int]) -> int:
        for count in sorted(self._buckets):
            for block in self._buckets[count]:
                if block not in skip:
                    self._victims += 1
                    if self._victims % self._halve_every == 0:
                        self._halve()
                    return block
        raise StopIteration("no evictable block")

    def record_reuse(self, block: int) -> None:
        """A sequence takes `block` for a prefix it matched (it is not evictable meanwhile)."""
        self._reuses[block] = self.reuses(block) + 1

    def forget(self, block: int) -> None:
        """`block` no longer holds the prefix its reuses were counted for."""
        self._reuses.pop(block, None)

    def clear(self) -> None:
        self._reuses.clear()
        self._buckets.clear()
        self._bucket_of.clear()

    def _halve(self) -> None:
        self._reuses = {block: count // 2 for block, count in self._reuses.items() if count > 1}
        evictable = [block for count in sorted(self._buckets) for block in self._buckets[count]]
        self._buckets.clear()
        self._bucket_of.clear()
        for block in evictable:    # ascending counts, oldest first within one: the order stays
            self.add(block)

    def __contains__(self, block: object) -> bool:
        return block in self._bucket_of

    def __len__(self) -> int:
        return len(self._bucket_of)

    def __iter__(self) -> Iterator[int]:
        return (block for count in sorted(self._buckets) for block in self._buckets[count])


def make_eviction_policy(name: str, num_blocks: int) -> EvictionPolicy:
    if name == "lru":
        return LruEviction()
    if name == "lfu":
        return LfuEviction(halve_every=LFU_HALVING_PERIOD_IN_POOLS * num_blocks)
    raise ValueError(f"unknown eviction policy {name!r}; expected one of {', '.join(EVICTION_POLICIES)}")
