"""The block pool's invariant checker (tests run it after every step), apart from the
bookkeeping it checks: every block in exactly one state, reference counts equal to
table entries, the hash, tail and alias indexes agreeing with the blocks' entries.
It reads the pool's state (pool_state.py) and changes nothing.
"""

from __future__ import annotations

from common.block_hash import ROOT_HASH
from common.step import PoolStats
from services.worker.engine.kv.pool_state import PoolState


class PoolInvariantError(AssertionError):
    pass


def check_invariants(s: PoolState, stats: PoolStats) -> None:
    """Raises PoolInvariantError when the bookkeeping is inconsistent (tests call it every step)."""
    owners = [0] * s.num_blocks
    for seq_id, table in s.tables.items():
        if len(set(table)) != len(table):
            raise PoolInvariantError(f"sequence {seq_id} holds a block twice: {table}")
        for block in table:
            owners[block] += 1
    free = set(s.free)
    if len(free) != len(s.free):
        raise PoolInvariantError("a block is on the free list twice")
    evictable = set(s.evictable)
    for block in range(s.num_blocks):
        count = s.refcount[block]
        if count < 0:
            raise PoolInvariantError(f"block {block} has refcount {count}")
        if count != owners[block]:
            raise PoolInvariantError(f"block {block} refcount {count} but {owners[block]} owners")
        states = (count > 0) + (block in free) + (block in evictable)
        if states != 1:
            raise PoolInvariantError(f"block {block} is in {states} states")
        _check_entry(s, block, count, block in free)
    for value, block in s.by_hash.items():
        if s.block_hash[block] != value:
            raise PoolInvariantError(f"hash map points {value} at block {block}")
    _check_tail_index(s)
    _check_aliases(s)
    used = sum(1 for count in s.refcount if count > 0)
    if len(free) + len(evictable) + used != s.num_blocks:
        raise PoolInvariantError(f"free {len(free)} + cached {len(evictable)} + used {used} "
                                 f"!= total {s.num_blocks}")
    if stats.used_blocks != used:
        raise PoolInvariantError(f"stats report {stats.used_blocks} used blocks, counted {used}")

def _check_entry(s: PoolState, block: int, refcount: int, free: bool) -> None:
    tokens = s.block_tokens[block]
    value = s.block_hash[block]
    partial = block in s.partials
    if free and (tokens is not None or value is not None or partial or s.block_salt[block]):
        raise PoolInvariantError(f"free block {block} still holds a hash or partial entry")
    if refcount == 0 and not free and tokens is None:
        raise PoolInvariantError(f"cached block {block} holds neither a hash nor a partial entry")
    if partial and (refcount > 0 or value is not None or tokens is None
                    or not 0 < len(tokens) < s.block_size):
        raise PoolInvariantError(f"partial block {block} is referenced, hashed or malformed")
    if value is not None and (tokens is None or len(tokens) != s.block_size):
        raise PoolInvariantError(f"full block {block} does not hold its {s.block_size} tokens")
    if not partial and value is None and tokens is not None:
        raise PoolInvariantError(f"block {block} holds tokens but no entry")

def _check_tail_index(s: PoolState) -> None:
    indexed = 0
    for (parent, salt, first), blocks in s.tails.items():
        for block in blocks:
            tokens = s.block_tokens[block]
            if (tokens is None or tokens[0] != first or s.parent_hash[block] != parent
                    or s.block_salt[block] != salt):
                raise PoolInvariantError(f"tail index points ({parent}, {salt!r}, {first}) at block {block}")
            indexed += 1
    holding = sum(1 for tokens in s.block_tokens if tokens is not None)
    if indexed != holding:
        raise PoolInvariantError(f"tail index lists {indexed} blocks, {holding} hold entries")
    for block in s.held:
        if s.block_tokens[block] is None:
            raise PoolInvariantError(f"held block {block} holds no entry")

def _check_aliases(s: PoolState) -> None:
    under: dict[int, set[int]] = {}
    carried = 0
    for alias, blocks in s.aliases.blocks.items():
        if not alias or not blocks:
            raise PoolInvariantError(f"alias {alias} is zero or carried by no block")
        parents = {s.parent_hash[block] for block in blocks}
        if len(parents) != 1:
            raise PoolInvariantError(f"alias {alias} is carried under several parents {parents}")
        (parent,) = parents
        if parent != ROOT_HASH:
            if parent not in s.by_hash:
                raise PoolInvariantError(f"alias {alias} is published under unregistered parent {parent}")
            under.setdefault(parent, set()).add(alias)
        for block in blocks:
            if block not in s.partials or s.aliases.of.get(block) != alias:
                raise PoolInvariantError(f"alias {alias} lists block {block}, not a partial entry carrying it")
        carried += len(blocks)
    if carried != len(s.aliases.of):
        raise PoolInvariantError(f"{len(s.aliases.of)} blocks carry an alias, alias sets list {carried}")
    if under != s.aliases.under:
        raise PoolInvariantError("aliases by parent disagree with the alias sets")
