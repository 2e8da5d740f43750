"""The paged KV cache's block bookkeeping (its tensors are kv_cache.py's).

Every block is in exactly one state:
  used    refcount > 0 (in at least one sequence's block table),
  cached  refcount == 0 but holding a registered full-block hash or a partial
          entry (reusable, evictable),
  free    refcount == 0 and neither.
A partial entry is the computed head of a sequence's last, partly filled block,
keyed by its parent's hash and its tokens. It is only ever copied from (the
exact-match path), never put in a block table. When a whole prompt ends inside
it, the engine gives it an alias: the prompt's partial-block hash
(common/block_hash.py), under which the KV index knows it. An alias
is published (STORED with partial_hash, no full hashes) when the first entry
carrying it is kept, and withdrawn (REMOVED) when the last one is forgotten, or
as soon as its parent's full-block hash is: the index only keeps a partial
block under a parent the worker holds. Entries without an alias are never
published. Several entries may carry one alias: the same prompt, continued
differently.
Blocks of sequences with different cache salts never meet: their hashes differ
(common/block_hash.py), and the tail index is keyed by the salt too, since a
block after the root has the root's hash, 0, as parent whatever its salt.
Which cached block is evicted is the eviction policy's choice (eviction.py:
least recently released, or fewest reuses); under either, leaves go before the
prefixes they extend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.block_hash import ROOT_HASH
from common.step import PoolStats
from services.worker.engine.kv.pool_invariants import check_invariants
from services.worker.engine.kv.pool_snapshot import hash_chains
from services.worker.engine.kv.pool_state import PoolState
from services.worker.engine.types import BlockEvent, PoolListener


@dataclass(frozen=True)
class PartialBlock:
    """The computed head of a sequence's partly filled block, kept when the sequence is freed."""
    block_index: int            # in the sequence's block table
    tokens: tuple[int, ...]     # tokens whose K/V its first slots hold; 0 < len < block_size
    parent_hash: int            # hash of the full block before it (ROOT_HASH for the first)
    alias_hash: int = 0         # the whole prompt's partial-block hash when the prompt ends in it; 0: none
    cache_salt: str = ""        # its sequence's: only sequences with the same salt copy from it


class BlockPool:
    """Block ownership, reference counts and the prefix cache. Pure bookkeeping:
    it never touches tensors, so it is cheap to test exhaustively. Its state is one
    PoolState (pool_state.py), with the published aliases in it (pool_aliases.py); the
    invariant checker reads that state (pool_invariants.py)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 eviction_policy: str = "lru") -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._state = PoolState.empty(num_blocks, block_size, eviction_policy)
        self._events: list[BlockEvent] = []
        self.evictions = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.listener: PoolListener | None = None

    # ---- queries -------------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: str) -> list[int]:
        return self._state.tables.get(seq_id, [])

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._state.tables

    def num_allocatable(self) -> int:
        held_cached = sum(1 for block in self._state.held if block in self._state.evictable)
        return len(self._state.free) + len(self._state.evictable) - held_cached

    def find_cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes` (a chain of full-block hashes)."""
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        for value in hashes:
            block = self._state.by_hash.get(value)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def find_cached_tail(self, parent_hash: int, tail: Sequence[int], cache_salt: str = "") -> int | None:
        """A block (registered full, or partial) of `cache_salt` after `parent_hash` whose
        computed tokens start with `tail`: its first len(tail) slots hold their K/V."""
        found = self.find_longest_tail(parent_hash, tail, cache_salt)
        return found[0] if found is not None and found[1] == len(tail) else None

    def find_longest_tail(self, parent_hash: int, tokens: Sequence[int],
                          cache_salt: str = "") -> tuple[int, int] | None:
        """The block (registered full, or partial) of `cache_salt` after `parent_hash` sharing
        the longest run of leading tokens with `tokens`, and that run's length: the block's
        first that-many slots hold the K/V those tokens would get."""
        if not self.enable_prefix_caching or not tokens:
            return None
        best: tuple[int, int] | None = None
        for block in self._state.tails.get((parent_hash, cache_salt, tokens[0]), ()):
            block_tokens = self._state.block_tokens[block]
            assert block_tokens is not None
            matched = _common_prefix_len(block_tokens, tokens)
            if best is None or matched > best[1]:
                best = (block, matched)
                if matched >= len(tokens):
                    break
        return best

    def stats(self) -> PoolStats:
        # Partial blocks count as free: they hold no published prefix (the KV index
        # counts exactly the cached blocks) and are evicted like any cached block.
        used = self.num_blocks - len(self._state.free) - len(self._state.evictable)
        partial = len(self._state.partials)
        return PoolStats(total_blocks=self.num_blocks, free_blocks=len(self._state.free) + partial,
                         cached_blocks=len(self._state.evictable) - partial, used_blocks=used,
                         evictions=self.evictions, prefix_hit_tokens=self.prefix_hit_tokens,
                         prefix_query_tokens=self.prefix_query_tokens)

    # ---- allocation ----------------------------------------------------------------------

    def can_allocate(self, seq_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Whether `seq_id`'s table can grow to cover `num_tokens` tokens. `cached_blocks`
        (only for a sequence without blocks yet) are reused as its leading blocks."""
        return self._new_blocks_needed(seq_id, num_tokens, cached_blocks) is not None

    def allocate(self, seq_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Grows `seq_id`'s block table to cover `num_tokens` tokens, evicting cached blocks
        (eviction.py's order) when the free list runs short.

        A new sequence whose first 8 prompt tokens hit the prefix cache, allocated for a
        14-token prompt (block_size 4, cached_blocks [7, 3], num_tokens 14):

            token slots   0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13 __ __
            table       [     7      |     3      |    12      |     5      ]
                         cached: reused, ref'd    new: computed this step; the last
                         (no forward for them)    block's free slots take the next
                                                  tokens without another allocation

        Later calls for the same sequence (num_tokens growing by a decode or a chunk)
        append blocks only when the last one is full.

        Args:
            seq_id: the sequence whose table grows (created when new).
            num_tokens: the tokens the table must cover after this call (computed ones,
                this step's, and speculative drafts the step verifies).
            cached_blocks: cached blocks to reuse as a new sequence's leading blocks
                (`find_cached_prefix`); empty for a sequence that already has blocks.

        Returns:
            True when the table covers `num_tokens`; False, with nothing changed, when
            the free and evictable blocks cannot cover it.
        """
        needed = self._new_blocks_needed(seq_id, num_tokens, cached_blocks)
        if needed is None:
            return False
        table = self._state.tables.setdefault(seq_id, [])
        for block in cached_blocks:
            self._state.evictable.record_reuse(block)
            self._take(block)
            table.append(block)
        removed: list[int] = []
        for _ in range(needed):
            block = self._pop_free_block(removed)
            if self.listener is not None:
                self.listener.block_reused(block)
            self._take(block)
            table.append(block)
        if removed:
            self._events.append(BlockEvent.removed(removed))
        return True

    def hold(self, block: int) -> None:
        """Keeps `block` from being evicted until `release`; its state does not change."""
        self._state.held[block] = self._state.held.get(block, 0) + 1

    def release(self, block: int) -> None:
        count = self._state.held.pop(block)
        if count > 1:
            self._state.held[block] = count - 1

    def free(self, seq_id: str, partial: PartialBlock | None = None) -> None:
        """Drops `seq_id`'s references; blocks with a prefix hash stay cached, and so does
        `partial` as a partial entry unless the block is shared or its tokens are already
        covered by another entry."""
        table = self._state.tables.pop(seq_id, None)
        if table is None:
            return
        if partial is not None:
            self._keep_partial(table, partial)
        for block in reversed(table):   # tail first: children become evictable before parents
            self._unref(block)
        if self.listener is not None:
            self.listener.table_changed(seq_id, ())

    def shrink(self, seq_id: str, num_tokens: int) -> None:
        """Drops `seq_id`'s blocks past the ones covering `num_tokens` tokens (slots that
        were reserved for speculative tokens and then rejected)."""
        table = self._state.tables.get(seq_id)
        if not table:
            return
        keep = self.blocks_for(num_tokens)
        for block in reversed(table[keep:]):
            self._unref(block)
        del table[keep:]
        if self.listener is not None:
            self.listener.table_changed(seq_id, table)

    def replace_table(self, seq_id: str, blocks: Sequence[int]) -> None:
        """Gives `seq_id` the table `blocks` in place of its own (each block referenced or
        cached): the new entries are referenced before the old ones are released."""
        for block in blocks:
            self._take(block)
        old = self._state.tables.get(seq_id, [])
        self._state.tables[seq_id] = list(blocks)
        for block in reversed(old):
            self._unref(block)
        if self.listener is not None:
            self.listener.table_changed(seq_id, self._state.tables[seq_id])

    def drop(self, seq_id: str, indices: Sequence[int]) -> None:
        """Takes the blocks at `indices` out of `seq_id`'s table (a lossy KV policy evicting
        them: kv_policy.py); the later ones move up."""
        table = self._state.tables[seq_id]
        gone = set(indices)
        for index in sorted(gone, reverse=True):
            self._unref(table[index])
        table[:] = [block for index, block in enumerate(table) if index not in gone]
        if self.listener is not None:
            self.listener.table_changed(seq_id, table)

    def _unref(self, block: int) -> None:
        self._state.refcount[block] -= 1
        if self._state.refcount[block] > 0:
            return
        if self._state.block_tokens[block] is None:
            self._state.free.append(block)
        else:
            self._state.evictable.add(block)

    def record_prefix_query(self, query_tokens: int, hit_tokens: int) -> None:
        self.prefix_query_tokens += query_tokens
        self.prefix_hit_tokens += hit_tokens

    def cache_full_blocks(self, seq_id: str, first_block: int, hashes: Sequence[int],
                          parent_hash: int, tokens: Sequence[int], cache_salt: str = "") -> None:
        """Registers the hashes of `seq_id`'s newly full blocks first_block.. (KV written);
        `tokens` are the sequence's tokens, covering at least those blocks; `hashes` were
        computed with its `cache_salt`, under which the blocks' tokens are found.
        A hash some other block already holds leaves this block unregistered (a duplicate)."""
        if not self.enable_prefix_caching or not hashes:
            return
        table = self._state.tables[seq_id]
        size = self.block_size
        run: list[int] = []
        run_parent = parent_hash
        for offset, value in enumerate(hashes):
            index = first_block + offset
            block = table[index]
            if self._state.block_hash[block] is None and value not in self._state.by_hash:
                self._state.block_hash[block] = value
                self._state.by_hash[value] = block
                self._add_tail(block, parent_hash, tokens[index * size:(index + 1) * size], cache_salt)
                if not run:
                    run_parent = parent_hash
                run.append(value)
            elif run:
                self._events.append(BlockEvent.stored(run, run_parent))
                run = []
            parent_hash = value
        if run:
            self._events.append(BlockEvent.stored(run, run_parent))

    def clear_cache(self) -> None:
        """Forgets every prefix hash and partial entry; unreferenced cached blocks become free.
        CLEARED withdraws every published alias too."""
        for block in self._state.evictable:
            self._state.free.append(block)
        self._state.evictable.clear()
        for blocks in list(self._state.tails.values()):
            for block in list(blocks):
                self._forget(block)
        self._state.aliases.clear()
        self._events.append(BlockEvent.cleared())

    def check_invariants(self) -> None:
        """Raises PoolInvariantError when the bookkeeping is inconsistent (tests call it every step)."""
        check_invariants(self._state, self.stats())

    def drain_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    def cached_chains(self) -> list[tuple[int, list[int]]]:
        """Every registered block as chains (parent_hash, [hashes in prefix order])."""
        return hash_chains(self._state.by_hash, self._state.parent_hash)

    def cached_partials(self) -> list[tuple[int, int]]:
        """Every published alias as (parent_hash, alias), once however many partial
        entries carry it; the parent is the root or a registered full block."""
        return [(self._state.parent_hash[block], alias) for alias, block in self._state.aliases.published()]

    # ---- internals -----------------------------------------------------------------------

    def _new_blocks_needed(self, seq_id: str, num_tokens: int, cached_blocks: Sequence[int]) -> int | None:
        table = self._state.tables.get(seq_id, [])
        if cached_blocks and table:
            raise ValueError("cached blocks can only start an empty block table")
        have = len(table) + len(cached_blocks)
        needed = max(0, self.blocks_for(num_tokens) - have)
        revived = sum(1 for block in cached_blocks if self._state.refcount[block] == 0)
        if needed > self.num_allocatable() - revived:
            return None
        return needed

    def _take(self, block: int) -> None:
        if self._state.refcount[block] == 0 and block in self._state.evictable:
            self._state.evictable.remove(block)
        self._state.refcount[block] += 1

    def _pop_free_block(self, removed: list[int]) -> int:
        if self._state.free:
            return self._state.free.pop()
        block = self._state.evictable.victim(self._state.held)
        self._state.evictable.remove(block)
        value = self._state.block_hash[block]
        if value is not None:
            removed.append(value)
        self._forget(block, removed)
        self.evictions += 1
        return block

    def _keep_partial(self, table: list[int], partial: PartialBlock) -> None:
        if not self.enable_prefix_caching or not 0 < len(partial.tokens) < self.block_size:
            return
        block = table[partial.block_index]
        if self._state.refcount[block] != 1 or self._state.block_tokens[block] is not None:
            return
        if self.find_cached_tail(partial.parent_hash, partial.tokens, partial.cache_salt) is not None:
            return
        self._state.partials.add(block)
        parent, alias = partial.parent_hash, partial.alias_hash
        self._add_tail(block, parent, partial.tokens, partial.cache_salt)
        if alias and (parent == ROOT_HASH or parent in self._state.by_hash):
            if self._state.aliases.add(block, alias, parent):   # the first entry carrying it publishes it
                self._events.append(BlockEvent.stored([], parent, partial_hash=alias))

    def _add_tail(self, block: int, parent_hash: int, tokens: Sequence[int], cache_salt: str) -> None:
        self._state.block_tokens[block] = tuple(tokens)
        self._state.parent_hash[block] = parent_hash
        self._state.block_salt[block] = cache_salt
        self._state.tails.setdefault((parent_hash, cache_salt, tokens[0]), {})[block] = None

    def _forget(self, block: int, removed: list[int] | None = None) -> None:
        """Drops `block`'s hash or partial entry (its refcount and state are the caller's).
        Aliases this withdraws (its own, or those published under its hash) go to `removed`."""
        tokens = self._state.block_tokens[block]
        assert tokens is not None
        key = (self._state.parent_hash[block], self._state.block_salt[block], tokens[0])
        del self._state.tails[key][block]
        if not self._state.tails[key]:
            del self._state.tails[key]
        withdrawn: list[int] = []
        value = self._state.block_hash[block]
        if value is not None:
            del self._state.by_hash[value]
            withdrawn.extend(self._state.aliases.withdraw_under(value))   # the entries stay, unpublished
        alias = self._state.aliases.drop(block, self._state.parent_hash[block])
        if alias is not None:
            withdrawn.append(alias)
        if removed is not None:
            removed.extend(withdrawn)
        self._state.partials.discard(block)
        self._state.evictable.forget(block)
        self._state.block_hash[block] = None
        self._state.block_tokens[block] = None
        self._state.block_salt[block] = ""
        self._state.parent_hash[block] = ROOT_HASH


def _common_prefix_len(left: Sequence[int], right: Sequence[int]) -> int:
    length = 0
    for a, b in zip(left, right):
        if a != b:
            break
        length += 1
    return length
