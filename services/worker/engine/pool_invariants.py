"""The block pool's invariant checker (tests run it after every step), apart from the
bookkeeping it checks: every block in exactly one state, reference counts equal to
table entries, the hash, tail and alias indexes agreeing with the blocks' entries.
"""

from __future__ import annotations

from collections.abc import Callable

from common.block_hash import ROOT_HASH
from services.worker.engine.eviction import EvictionPolicy
from common.step import PoolStats


TailKey = tuple[int, str, int]   # (parent hash, cache salt, first token): a tail index entry's


class PoolInvariantError(AssertionError):
    pass


class PoolInvariants:
    """check_invariants of BlockPool, over the pool's own fields."""

    num_blocks: int
    block_size: int
    _refcount: list[int]
    _block_hash: list[int | None]
    _parent_hash: list[int]
    _block_tokens: list[tuple[int, ...] | None]
    _block_salt: list[str]
    _by_hash: dict[int, int]
    _partials: set[int]
    _tails: dict[TailKey, dict[int, None]]
    _held: dict[int, int]
    _alias_of: dict[int, int]
    _alias_blocks: dict[int, dict[int, None]]
    _aliases_under: dict[int, set[int]]
    _free: list[int]
    _evictable: EvictionPolicy
    _tables: dict[str, list[int]]
    stats: Callable[[], PoolStats]   # BlockPool's

    def check_invariants(self) -> None:
        """Raises PoolInvariantError when the bookkeeping is inconsistent (tests call it every step)."""
        owners = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise PoolInvariantError(f"sequence {seq_id} holds a block twice: {table}")
            for block in table:
                owners[block] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise PoolInvariantError("a block is on the free list twice")
        evictable = set(self._evictable)
        for block in range(self.num_blocks):
            count = self._refcount[block]
            if count < 0:
                raise PoolInvariantError(f"block {block} has refcount {count}")
            if count != owners[block]:
                raise PoolInvariantError(f"block {block} refcount {count} but {owners[block]} owners")
            states = (count > 0) + (block in free) + (block in evictable)
            if states != 1:
                raise PoolInvariantError(f"block {block} is in {states} states")
            self._check_entry(block, count, block in free)
        for value, block in self._by_hash.items():
            if self._block_hash[block] != value:
                raise PoolInvariantError(f"hash map points {value} at block {block}")
        self._check_tail_index()
        self._check_aliases()
        used = sum(1 for count in self._refcount if count > 0)
        if len(free) + len(evictable) + used != self.num_blocks:
            raise PoolInvariantError(f"free {len(free)} + cached {len(evictable)} + used {used} "
                                     f"!= total {self.num_blocks}")
        if self.stats().used_blocks != used:
            raise PoolInvariantError(f"stats report {self.stats().used_blocks} used blocks, counted {used}")

    def _check_entry(self, block: int, refcount: int, free: bool) -> None:
        tokens = self._block_tokens[block]
        value = self._block_hash[block]
        partial = block in self._partials
        if free and (tokens is not None or value is not None or partial or self._block_salt[block]):
            raise PoolInvariantError(f"free block {block} still holds a hash or partial entry")
        if refcount == 0 and not free and tokens is None:
            raise PoolInvariantError(f"cached block {block} holds neither a hash nor a partial entry")
        if partial and (refcount > 0 or value is not None or tokens is None
                        or not 0 < len(tokens) < self.block_size):
            raise PoolInvariantError(f"partial block {block} is referenced, hashed or malformed")
        if value is not None and (tokens is None or len(tokens) != self.block_size):
            raise PoolInvariantError(f"full block {block} does not hold its {self.block_size} tokens")
        if not partial and value is None and tokens is not None:
            raise PoolInvariantError(f"block {block} holds tokens but no entry")

    def _check_tail_index(self) -> None:
        indexed = 0
        for (parent, salt, first), blocks in self._tails.items():
            for block in blocks:
                tokens = self._block_tokens[block]
                if (tokens is None or tokens[0] != first or self._parent_hash[block] != parent
                        or self._block_salt[block] != salt):
                    raise PoolInvariantError(f"tail index points ({parent}, {salt!r}, {first}) at block {block}")
                indexed += 1
        holding = sum(1 for tokens in self._block_tokens if tokens is not None)
        if indexed != holding:
            raise PoolInvariantError(f"tail index lists {indexed} blocks, {holding} hold entries")
        for block in self._held:
            if self._block_tokens[block] is None:
                raise PoolInvariantError(f"held block {block} holds no entry")

    def _check_aliases(self) -> None:
        under: dict[int, set[int]] = {}
        carried = 0
        for alias, blocks in self._alias_blocks.items():
            if not alias or not blocks:
                raise PoolInvariantError(f"alias {alias} is zero or carried by no block")
            parents = {self._parent_hash[block] for block in blocks}
            if len(parents) != 1:
                raise PoolInvariantError(f"alias {alias} is carried under several parents {parents}")
            (parent,) = parents
            if parent != ROOT_HASH:
                if parent not in self._by_hash:
                    raise PoolInvariantError(f"alias {alias} is published under unregistered parent {parent}")
                under.setdefault(parent, set()).add(alias)
            for block in blocks:
                if block not in self._partials or self._alias_of.get(block) != alias:
                    raise PoolInvariantError(f"alias {alias} lists block {block}, not a partial entry carrying it")
            carried += len(blocks)
        if carried != len(self._alias_of):
            raise PoolInvariantError(f"{len(self._alias_of)} blocks carry an alias, alias sets list {carried}")
        if under != self._aliases_under:
            raise PoolInvariantError("aliases by parent disagree with the alias sets")
