"""The block pool's published aliases (block_pool.py's docstring): a kept partial block
whose tokens end a whole prompt carries the prompt's partial-block hash, under which the
KV index knows it; published with the first entry that carries it and withdrawn with the
last, or with the full block it hangs under."""

from __future__ import annotations

from collections.abc import Iterator

from common.block_hash import ROOT_HASH


class PartialAliases:
    """Which alias each partial entry carries, the entries carrying each alias, and the
    aliases published under each parent hash (the root's are not kept there). The pool owns
    one and says which parent each entry hangs under; publishing is the pool's."""

    def __init__(self) -> None:
        self.of: dict[int, int] = {}                    # partial block -> its published alias
        self.blocks: dict[int, dict[int, None]] = {}    # alias -> partial blocks carrying it
        self.under: dict[int, set[int]] = {}            # parent hash (not the root) -> aliases

    def add(self, block: int, alias: int, parent: int) -> bool:
        """Gives the partial entry `block`, under `parent`, `alias`; True when no other entry
        carried it yet (the pool publishes it then)."""
        blocks = self.blocks.get(alias)
        first = blocks is None
        if blocks is None:
            blocks = self.blocks[alias] = {}
            if parent != ROOT_HASH:
                self.under.setdefault(parent, set()).add(alias)
        blocks[block] = None
        self.of[block] = alias
        return first

    def drop(self, block: int, parent: int) -> int | None:
        """Takes the alias of `block` (under `parent`) away; returns it when no other entry
        carries it (the pool withdraws it then)."""
        alias = self.of.pop(block, None)
        if alias is None:
            return None
        blocks = self.blocks[alias]
        del blocks[block]
        if blocks:
            return None
        del self.blocks[alias]
        aliases = self.under.get(parent)
        if aliases is not None:
            aliases.discard(alias)
            if not aliases:
                del self.under[parent]
        return alias

    def withdraw_under(self, parent: int) -> list[int]:
        """Withdraws every alias published under the full-block hash `parent` (being forgotten):
        their entries stay, unpublished; returns the aliases."""
        withdrawn = []
        for alias in self.under.pop(parent, ()):
            for block in self.blocks.pop(alias):
                del self.of[block]
            withdrawn.append(alias)
        return withdrawn

    def published(self) -> Iterator[tuple[int, int]]:
        """Every published alias, once, with one of the entries carrying it: (alias, block)."""
        for alias, blocks in self.blocks.items():
            yield alias, next(iter(blocks))

    def clear(self) -> None:
        self.of.clear()
        self.blocks.clear()
        self.under.clear()
