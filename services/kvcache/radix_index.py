"""A radix tree over chained block hashes, recording which workers hold each
block, plus the exact-match map of whole prompts' partial last blocks.

Each edge holds a run of block hashes that share one set of holders, so a
long prompt cached by the same workers is a single node. Runs split where a
branch starts or where the holders change, and merge back when a node is
left with one child holding the same workers.

A worker "holds" a block when it published it and has not removed it since.
Matching a prefix for a worker stops at the first block it does not hold,
even if it holds deeper ones: a prefix is only reusable from the root.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from common.block_hash import ROOT_HASH
from services.kvcache.kv_types import AllCleared, BlockRemoved, BlockStored, EventBody
from services.kvcache.rules import order_chains


class InconsistentEvent(ValueError):
    """An event that contradicts what the index knows about the worker (a
    chain whose parent the worker does not hold, or a hash placed under a
    different parent). The worker must resync."""


class _Node:
    __slots__ = ("hashes", "workers", "parent", "children", "alive")

    def __init__(self, hashes: list[int], workers: set[str], parent: _Node | None) -> None:
        self.hashes = hashes
        self.workers = workers
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.alive = True


class RadixIndex:
    def __init__(self) -> None:
        self._root = _Node([], set(), None)
        self._where: dict[int, tuple[_Node, int]] = {}
        self._held: dict[str, set[int]] = {}
        self._partials: dict[int, set[str]] = {}
        self._held_partials: dict[str, set[int]] = {}
        self._nodes = 0

    # ----------------------------------------------------------------- reads

    @property
    def num_nodes(self) -> int:
        """Nodes of the tree, the root excluded."""
        return self._nodes

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes in the tree."""
        return len(self._where)

    def workers(self) -> set[str]:
        return {w for w, held in self._held.items() if held} | {
            w for w, held in self._held_partials.items() if held}

    def blocks_of(self, worker_id: str) -> frozenset[int]:
        return frozenset(self._held.get(worker_id, ()))

    def partials_of(self, worker_id: str) -> frozenset[int]:
        return frozenset(self._held_partials.get(worker_id, ()))

    def blocks_by_worker(self) -> dict[str, int]:
        return {w: len(held) for w, held in self._held.items() if held}

    def holds(self, worker_id: str, block_hash: int) -> bool:
        return block_hash in self._held.get(worker_id, ())

    def partial_holders(self, partial_hash: int) -> frozenset[str]:
        return frozenset(self._partials.get(partial_hash, ()))

    def match_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        """How far each worker's cache covers a prompt.

        Args:
            hashes: the prompt's chained block hashes (common/block_hash.py), in order.

        Returns:
            worker id -> how many leading blocks of `hashes` it holds, for each worker
            holding at least the first; empty when none does.
        """
        result: dict[str, int] = {}
        active: set[str] | None = None
        node, offset = self._root, -1
        matched = 0
        for block in hashes:
            if offset + 1 < len(node.hashes):
                if node.hashes[offset + 1] != block:
                    break
                offset += 1
            else:
                child = node.children.get(block)
                if child is None:
                    break
                node, offset = child, 0
                if active is None:
                    active = set(child.workers)
                else:
                    for worker in active - child.workers:
                        result[worker] = matched
                    active &= child.workers
                if not active:
                    break
            matched += 1
        for worker in active or ():
            result[worker] = matched
        return result

    # ---------------------------------------------------------------- writes

    def apply(self, worker_id: str, event: EventBody) -> None:
        if isinstance(event, BlockStored):
            self.insert(worker_id, event.parent_hash, event.block_hashes, event.partial_hash)
        elif isinstance(event, BlockRemoved):
            self.remove(worker_id, event.block_hashes)
        elif isinstance(event, AllCleared):
            self.clear(worker_id)
        else:
            raise TypeError(f"unknown event {event!r}")

    def insert(self, worker_id: str, parent_hash: int, hashes: Sequence[int],
               partial_hash: int = 0) -> None:
        """Records that the worker holds the chain `hashes` under `parent_hash`
        (and the partial block `partial_hash` after it). Idempotent."""
        self._validate_chain(worker_id, parent_hash, hashes)
        dirty: list[_Node] = []
        node, offset = self._position_after(parent_hash)
        runs: list[list] = []  # [node, start, end) of blocks already in the tree
        index = 0
        while index < len(hashes):
            block = hashes[index]
            if offset + 1 < len(node.hashes):
                if node.hashes[offset + 1] != block:
                    dirty.append(self._split(node, offset + 1))
                    break
                offset += 1
            else:
                child = node.children.get(block)
                if child is None:
                    break
                node, offset = child, 0
            if runs and runs[-1][0] is node:
                runs[-1][2] = offset + 1
            else:
                runs.append([node, offset, offset + 1])
            index += 1
        for run_node, start, end in runs:
            dirty.extend(self._set_holder(run_node, start, end, worker_id, True))
        if index < len(hashes):
            # Splits above may have moved the last matched block to a new node.
            node, _ = self._position_after(hashes[index - 1] if index else parent_hash)
            dirty.append(self._add_leaf(node, list(hashes[index:]), worker_id))
        self._held.setdefault(worker_id, set()).update(hashes)
        if partial_hash:
            self._partials.setdefault(partial_hash, set()).add(worker_id)
            self._held_partials.setdefault(worker_id, set()).add(partial_hash)
        self._normalize_all(dirty)

    def remove(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Forgets that the worker holds these blocks or partial blocks;
        unknown hashes are ignored."""
        held = self._held.get(worker_id, set())
        held_partials = self._held_partials.get(worker_id, set())
        offsets_by_node: dict[_Node, list[int]] = {}
        for block in set(hashes):
            if block in held:
                node, offset = self._where[block]
                offsets_by_node.setdefault(node, []).append(offset)
                held.discard(block)
            elif block in held_partials:
                held_partials.discard(block)
                holders = self._partials[block]
                holders.discard(worker_id)
                if not holders:
                    del self._partials[block]
        dirty: list[_Node] = []
        for node, offsets in offsets_by_node.items():
            # Highest ranges first: splitting a node keeps its lower offsets valid.
            for start, end in reversed(_contiguous_ranges(sorted(offsets))):
                dirty.extend(self._set_holder(node, start, end, worker_id, False))
        self._forget_worker_if_empty(worker_id)
        self._normalize_all(dirty)

    def clear(self, worker_id: str) -> None:
        self.remove(worker_id, [*self._held.get(worker_id, ()),
                                *self._held_partials.get(worker_id, ())])

    def replace_worker(self, worker_id: str, chains: Iterable[BlockStored]) -> int:
        """Full resync: the worker holds exactly `chains` (in any order).
        Returns how many chains were dropped because they do not hang off the
        root through blocks the worker holds, or contradict the tree."""
        self.clear(worker_id)
        ordered, dropped = order_chains(chains)
        for chain in ordered:
            try:
                self.insert(worker_id, chain.parent_hash, chain.block_hashes, chain.partial_hash)
            except InconsistentEvent:
                dropped += 1
        return dropped

    # --------------------------------------------------------------- helpers

    def _validate_chain(self, worker_id: str, parent_hash: int, hashes: Sequence[int]) -> None:
        if parent_hash != ROOT_HASH and not self.holds(worker_id, parent_hash):
            raise InconsistentEvent(
                f"worker {worker_id} stores blocks under {parent_hash}, which it does not hold")
        previous = parent_hash
        for block in hashes:
            known = self._where.get(block)
            if known is not None and self._parent_hash_of(*known) != previous:
                raise InconsistentEvent(f"block {block} is already indexed under another parent")
            previous = block

    def _parent_hash_of(self, node: _Node, offset: int) -> int:
        if offset > 0:
            return node.hashes[offset - 1]
        parent = node.parent
        assert parent is not None
        return parent.hashes[-1] if parent.hashes else ROOT_HASH

    def _position_after(self, parent_hash: int) -> tuple[_Node, int]:
        if parent_hash == ROOT_HASH:
            return self._root, -1
        return self._where[parent_hash]

    def _split(self, node: _Node, at: int) -> _Node:
        """Cuts node's run at `at`: node keeps [:at], a new child takes [at:]
        with the same holders and node's former children."""
        tail = _Node(node.hashes[at:], set(node.workers), node)
        tail.children = node.children
        for child in tail.children.values():
            child.parent = tail
        node.hashes = node.hashes[:at]
        node.children = {tail.hashes[0]: tail}
        for index, block in enumerate(tail.hashes):
            self._where[block] = (tail, index)
        self._nodes += 1
        return tail

    def _set_holder(self, node: _Node, start: int, end: int, worker_id: str,
                    holds: bool) -> list[_Node]:
        """Adds or removes the worker on node's run [start:end), splitting so
        that holders stay uniform along every run. Returns changed nodes."""
        if (worker_id in node.workers) == holds:
            return []
        changed: list[_Node] = [node]
        if end < len(node.hashes):
            changed.append(self._split(node, end))
        target = node
        if start > 0:
            target = self._split(node, start)
            changed.append(target)
        if holds:
            target.workers.add(worker_id)
        else:
            target.workers.discard(worker_id)
        return changed

    def _add_leaf(self, parent: _Node, hashes: list[int], worker_id: str) -> _Node:
        leaf = _Node(hashes, {worker_id}, parent)
        parent.children[hashes[0]] = leaf
        for index, block in enumerate(hashes):
            self._where[block] = (leaf, index)
        self._nodes += 1
        return leaf

    def _normalize_all(self, nodes: Iterable[_Node]) -> None:
        for node in nodes:
            self._normalize(node)

    def _normalize(self, node: _Node) -> None:
        """Restores the tree's shape around a changed node: no leaf without
        holders, no parent/only-child pair with the same holders."""
        while node.alive and node is not self._root:
            parent = node.parent
            assert parent is not None
            if not node.workers and not node.children:
                self._prune(node)
                node = parent
                continue
            if len(node.children) == 1:
                child = next(iter(node.children.values()))
                if child.workers == node.workers:
                    self._absorb_only_child(node)
                    continue
            if (parent is not self._root and len(parent.children) == 1
                    and parent.workers == node.workers):
                self._absorb_only_child(parent)
                node = parent
                continue
            break

    def _absorb_only_child(self, node: _Node) -> None:
        (child,) = node.children.values()
        base = len(node.hashes)
        node.hashes.extend(child.hashes)
        for index, block in enumerate(child.hashes):
            self._where[block] = (node, base + index)
        node.children = child.children
        for grandchild in node.children.values():
            grandchild.parent = node
        child.alive = False
        self._nodes -= 1

    def _prune(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.hashes[0]]
        for block in node.hashes:
            del self._where[block]
        node.alive = False
        self._nodes -= 1

    def _forget_worker_if_empty(self, worker_id: str) -> None:
        if not self._held.get(worker_id):
            self._held.pop(worker_id, None)
        if not self._held_partials.get(worker_id):
            self._held_partials.pop(worker_id, None)

    # ------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raises AssertionError when the tree's bookkeeping is inconsistent."""
        seen: dict[str, set[int]] = {}
        count = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            assert node.alive
            if node is not self._root:
                count += 1
                assert node.hashes, "empty run"
                assert node.workers or node.children, "leaf without holders"
                parent = node.parent
                assert parent is not None and parent.children[node.hashes[0]] is node
                if len(node.children) == 1:
                    (child,) = node.children.values()
                    assert child.workers != node.workers, "mergeable parent and only child"
            for index, block in enumerate(node.hashes):
                assert self._where[block] == (node, index)
                for worker in node.workers:
                    seen.setdefault(worker, set()).add(block)
            for key, child in node.children.items():
                assert child.hashes[0] == key and child.parent is node
                stack.append(child)
        assert count == self._nodes
        assert len(self._where) == sum(len(n.hashes) for n in self._iter_nodes())
        assert seen == {w: h for w, h in self._held.items() if h}
        partial_view: dict[str, set[int]] = {}
        for partial, holders in self._partials.items():
            assert holders
            for worker in holders:
                partial_view.setdefault(worker, set()).add(partial)
        assert partial_view == {w: p for w, p in self._held_partials.items() if p}

    def _iter_nodes(self) -> Iterable[_Node]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _contiguous_ranges(sorted_offsets: Sequence[int]) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    for offset in sorted_offsets:
        if ranges and ranges[-1][1] == offset:
            ranges[-1] = (ranges[-1][0], offset + 1)
        else:
            ranges.append((offset, offset + 1))
    return ranges
