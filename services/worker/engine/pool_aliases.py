"""The block pool's published aliases (block_pool.py's docstring): a kept partial block
whose tokens end a whole prompt carries the prompt's partial-block hash, under which the
KV index knows it; published with the first entry that carries it and withdrawn with the
last."""

from __future__ import annotations

from common.block_hash import ROOT_HASH
from services.worker.engine.types import BlockEvent


class PartialAliases:
    """The alias bookkeeping of BlockPool, over the pool's own fields."""

    _parent_hash: list[int]
    _alias_of: dict[int, int]
    _alias_blocks: dict[int, dict[int, None]]
    _aliases_under: dict[int, set[int]]
    _events: list[BlockEvent]

    def _add_alias(self, block: int, alias: int) -> None:
        """Publishes `alias` for the partial entry `block` unless another entry already did."""
        blocks = self._alias_blocks.get(alias)
        if blocks is None:
            blocks = self._alias_blocks[alias] = {}
            parent = self._parent_hash[block]
            if parent != ROOT_HASH:
                self._aliases_under.setdefault(parent, set()).add(alias)
            self._events.append(BlockEvent.stored([], parent, partial_hash=alias))
        blocks[block] = None
        self._alias_of[block] = alias

    def _drop_alias(self, block: int) -> int | None:
        """Takes `block`'s alias away; returns the alias when no other entry carries it."""
        alias = self._alias_of.pop(block, None)
        if alias is None:
            return None
        blocks = self._alias_blocks[alias]
        del blocks[block]
        if blocks:
            return None
        del self._alias_blocks[alias]
        parent = self._parent_hash[block]
        aliases = self._aliases_under.get(parent)
        if aliases is not None:
            aliases.discard(alias)
            if not aliases:
                del self._aliases_under[parent]
        return alias
