"""The simulated worker's prefix cache (sim_engine.py): which full blocks a simulated worker
holds, by the same chained hashes a real worker's pool publishes (common/block_hash.py), so
that the kvcache index learns them from the real publisher and the scheduler's cache-aware
routing sees real matches at any worker count.

A model of the real pool's cache, not a copy of it:

* a block is cached once a sequence has computed all of its tokens; a new sequence starts
  from the longest cached prefix of its prompt's full blocks (at least one prompt token is
  always computed, as on a real worker, so that one is sampled);
* the blocks no running sequence holds live in the pool's free space: `evict_to(room)` (after
  each step) evicts the least recently used of them until at most `room` are left, a chain's
  tail before its head;
* events: `stored` for each newly cached run of blocks (chained to its parent), `removed` for
  evictions, in the order they happened, drained after every step; no partial-block hashes
  (the exact-match fast path for a whole prompt) and no `cleared`: an epoch change keeps the
  cache, as a real pool's does.

Invariants (`check_invariants`): every cached hash has its parent cached or is a first block,
held counts are positive and held blocks cached.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from common.block_hash import ROOT_HASH, chain_hashes
from services.worker.engine.types import BlockEvent


class SimPrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: OrderedDict[int, int] = OrderedDict()   # hash -> parent hash, least recent first
        self._held: Counter[int] = Counter()                   # hash -> running sequences holding it
        self._events: list[BlockEvent] = []
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def held_blocks(self) -> int:
        """Cached blocks some running sequence holds."""
        return len(self._held)

    def prompt_chain(self, tokens: Sequence[int], key: str) -> list[int]:
        """The hashes of `tokens`' full blocks under `key` (the sequence's salted model key)."""
        return chain_hashes(tokens, self.block_size, key)

    def cached_blocks(self, chain: Sequence[int]) -> int:
        """How many of `chain`'s first blocks are cached."""
        count = 0
        for value in chain:
            if value not in self._blocks:
                break
            count += 1
        return count

    def hold(self, chain: Sequence[int]) -> None:
        """A sequence starts using these cached blocks (most recently used now)."""
        for value in chain:
            self._held[value] += 1
        self._touch(chain)

    def release(self, chain: Sequence[int]) -> None:
        """A sequence that held `chain` ended; its blocks stay cached until evicted, the most
        recently used from now (held blocks are never evicted, so their order only counts
        from here)."""
        for value in chain:
            self._held[value] -= 1
            if self._held[value] <= 0:
                del self._held[value]
        self._touch(chain)

    def store(self, chain: Sequence[int], start: int) -> None:
        """The blocks chain[start:] were just computed by a sequence that holds chain[:start]:
        cached (a block another sequence cached meanwhile is only held), held by it, published."""
        new, parent = [], chain[start - 1] if start else ROOT_HASH
        for index in range(start, len(chain)):
            value = chain[index]
            if value in self._blocks:
                self._flush(new, parent)
                new, parent = [], value
            else:
                self._blocks[value] = chain[index - 1] if index else ROOT_HASH
                new.append(value)
            self._held[value] += 1
        self._flush(new, parent)

    def _touch(self, chain: Sequence[int]) -> None:
        """Most recently used: the chain's last block first, its first block last, so that
        eviction takes a chain's tail before its head and a cached block's parent stays."""
        for value in reversed(chain):
            self._blocks.move_to_end(value)

    def _flush(self, hashes: list[int], parent: int) -> None:
        if hashes:
            self._events.append(BlockEvent.stored(hashes, parent))

    def evict_to(self, room: int) -> None:
        """Evicts unheld blocks, least recently used first, until at most `room` are left."""
        excess, removed = len(self._blocks) - len(self._held) - max(room, 0), []
        if excess > 0:
            for value in list(self._blocks):
                if len(removed) == excess:
                    break
                if value not in self._held:
                    del self._blocks[value]
                    removed.append(value)
        if removed:
            self.evictions += len(removed)
            self._events.append(BlockEvent.removed(removed))

    def drain_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    def snapshot_chains(self) -> list[tuple[int, list[int]]]:
        """Every cached block as a chain of one, chained to its parent (the publisher's resync)."""
        return [(parent, [value]) for value, parent in self._blocks.items()]

    def check_invariants(self) -> None:
        for value, parent in self._blocks.items():
            assert parent == ROOT_HASH or parent in self._blocks, f"block {value} cached without its parent"
        assert all(count > 0 for count in self._held.values()), "a held count that is not positive"
        assert set(self._held) <= set(self._blocks), "a held block that is not cached"
