"""The block pool's state, one object the pool owns (block_pool.py) and its invariant checker
reads (pool_invariants.py): per block its reference count, hash, parent, tokens and salt; the
indexes over them; the free list, the cached blocks' eviction policy, the sequences' tables
and the published aliases (pool_aliases.py). What each state means: block_pool.py's docstring."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.block_hash import ROOT_HASH
from services.worker.engine.kv.eviction import EvictionPolicy, make_eviction_policy
from services.worker.engine.kv.pool_aliases import PartialAliases

TailKey = tuple[int, str, int]   # (parent hash, cache salt, first token): a tail index entry's


@dataclass
class PoolState:
    num_blocks: int
    block_size: int
    evictable: EvictionPolicy                        # the cached blocks
    refcount: list[int] = field(default_factory=list)
    block_hash: list[int | None] = field(default_factory=list)
    parent_hash: list[int] = field(default_factory=list)
    block_tokens: list[tuple[int, ...] | None] = field(default_factory=list)   # full hash or partial
    block_salt: list[str] = field(default_factory=list)                        # of a block with tokens
    by_hash: dict[int, int] = field(default_factory=dict)
    partials: set[int] = field(default_factory=set)
    tails: dict[TailKey, dict[int, None]] = field(default_factory=dict)   # key -> blocks
    held: dict[int, int] = field(default_factory=dict)       # block -> holds (eviction skips it)
    aliases: PartialAliases = field(default_factory=PartialAliases)
    free: list[int] = field(default_factory=list)             # pop() hands out low ids first
    tables: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def empty(cls, num_blocks: int, block_size: int, eviction_policy: str) -> PoolState:
        """Every block free."""
        return cls(num_blocks, block_size, make_eviction_policy(eviction_policy, num_blocks),
                   refcount=[0] * num_blocks, block_hash=[None] * num_blocks,
                   parent_hash=[ROOT_HASH] * num_blocks, block_tokens=[None] * num_blocks,
                   block_salt=[""] * num_blocks, free=list(range(num_blocks - 1, -1, -1)))
