"""The sliding-window layers' own, smaller KV cache (the hybrid layout): a model whose
layers mix full attention and a sliding window (Gemma 3: five of every six layers look
only at the last 512 tokens) keeps the windowed layers' K/V in a second set of blocks,
and only for the pool blocks that some window still covers, so a long sequence holds
the full layers' K/V for every token and the sliding layers' for about one window.

A pool block (block_pool.py) holds block_size tokens' K/V for the full-attention layers;
the same tokens' K/V for the sliding layers live in the sliding block attached to it,
if any. Every sliding block is in exactly one state:
  pinned  attached to a pool block that at least one sequence's window covers;
  idle    attached to a pool block no window covers: kept, because a cached prefix
          whose last window is still attached can be reused; reclaimed least recently
          unpinned first;
  free    attached to nothing.
Attachments are one to one. A pool block handed out for new tokens loses its sliding
block (block_reused), and a sliding block is only ever attached to a pool block whose
tokens are still to be written or whose window the attaching sequence computes now,
so an attached sliding block holds its pool block's K/V wherever the pool block has it.

A sequence's window, when its next query is at cache position L, covers the table
entries from (L - window + 1) // block_size on; positions before are attended by no
later query of any sliding layer. In the sliding table those entries read NULL_BLOCK:
never attended (every sliding layer masks outside its window), so any block will do.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

NULL_BLOCK = 0


class SlidingBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        if num_blocks <= 0 or block_size <= 0 or window <= 0:
            raise ValueError("num_blocks, block_size and window must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self._sliding_of: dict[int, int] = {}             # pool block -> its sliding block
        self._pool_of: dict[int, int] = {}                # sliding block -> its pool block
        self._pins: dict[int, set[str]] = {}              # pool block -> sequences whose window covers it
        self._pinned_by: dict[str, list[int]] = {}        # sequence -> the pool blocks it pins, in table order
        self._idle: OrderedDict[int, None] = OrderedDict()  # idle pool blocks, least recently unpinned first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.reclaimed = 0

    # ---- queries -------------------------------------------------------------------------

    def first_in_window(self, position: int) -> int:
        """The first table entry a query at cache `position` (or any later one) attends to."""
        return max(0, position - self.window + 1) // self.block_size

    def attached(self, block: int) -> bool:
        return block in self._sliding_of

    def usable_prefix(self, blocks: Sequence[int]) -> int:
        """How many of the cached `blocks` (a prefix, in table order) a new sequence can
        reuse: the most whose window, seen from the first position after them, is attached."""
        missing = [0]
        for block in blocks:
            missing.append(missing[-1] + (block not in self._sliding_of))
        for count in range(len(blocks), 0, -1):
            first = self.first_in_window(count * self.block_size)
            if missing[count] == missing[first]:
                return count
        return 0

    def table(self, pool_table: Sequence[int], first: int) -> list[int]:
        """The sliding layers' block table of a sequence with `pool_table` whose window
        starts at entry `first` (every entry from `first` on must be attached)."""
        sliding_of = self._sliding_of
        return [NULL_BLOCK] * first + [sliding_of[block] for block in pool_table[first:]]

    def sliding_of(self, block: int) -> int:
        return self._sliding_of[block]

    def covers(self, seq_id: str, window_blocks: Sequence[int]) -> bool:
        """Whether `seq_id` pins exactly `window_blocks` already (all of them attached)."""
        return self._pinned_by.get(seq_id) == list(window_blocks)

    def pinned(self, seq_id: str) -> list[int]:
        """The pool blocks `seq_id`'s window covers (in table order)."""
        return list(self._pinned_by.get(seq_id, ()))

    def num_available(self, keep: Sequence[int] = ()) -> int:
        """Sliding blocks that can be attached without unpinning any: free ones, and idle
        ones not attached to a block of `keep`."""
        kept_idle = sum(1 for block in set(keep) if block in self._idle)
        return len(self._free) + len(self._idle) - kept_idle

    def can_cover(self, window_blocks: Sequence[int], new_blocks: int, protect: Sequence[int] = (),
                  seq_id: str = "") -> bool:
        """Whether `window_blocks` (pool blocks `seq_id`'s window will cover) plus `new_blocks`
        pool blocks not handed out yet can all be attached, keeping `protect`'s attachments
        (what `seq_id` alone pins outside its new window becomes reclaimable)."""
        keep = {*window_blocks, *protect}
        unattached = sum(1 for block in window_blocks if block not in self._sliding_of)
        released = sum(1 for block in self._pinned_by.get(seq_id, ())
                       if block not in keep and self._pins[block] == {seq_id})
        return unattached + new_blocks <= self.num_available(list(keep)) + released

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    # ---- changes -------------------------------------------------------------------------

    def cover(self, seq_id: str, window_blocks: Sequence[int], protect: Sequence[int] = ()) -> bool:
        """Makes `seq_id` pin exactly `window_blocks` (its window's pool blocks, in table
        order), attaching sliding blocks to those without one, never reclaiming `protect`'s.
        False, and nothing changed, when there are not enough sliding blocks."""
        if self.covers(seq_id, window_blocks):
            return True
        pinned = self._pinned_by.get(seq_id)
        if not self.can_cover(window_blocks, 0, protect, seq_id):
            return False
        for block in window_blocks:      # pin first: attaching below must not reclaim these
            self._pin(seq_id, block)
        keep = set(window_blocks)
        for block in pinned or ():
            if block not in keep:
                self._unpin(seq_id, block)
        for block in window_blocks:
            if block not in self._sliding_of:
                self._attach(block, protect)
        if window_blocks:
            self._pinned_by[seq_id] = list(window_blocks)
        else:
            self._pinned_by.pop(seq_id, None)
        return True

    def table_changed(self, seq_id: str, table: Sequence[int]) -> None:
        """`seq_id`'s pool table lost entries (freed, shrunk or dropped): it stops pinning
        the blocks no longer in it."""
        pinned = self._pinned_by.get(seq_id)
        if not pinned:
            return
        present = set(table)
        kept = [block for block in pinned if block in present]
        for block in pinned:
            if block not in present:
                self._unpin(seq_id, block)
        if kept:
            self._pinned_by[seq_id] = kept
        else:
            del self._pinned_by[seq_id]

    def block_reused(self, block: int) -> None:
        """The pool hands `block` out for new tokens: its sliding copy, if any, is stale."""
        for seq_id in list(self._pins.get(block, ())):
            self.table_changed(seq_id, [b for b in self._pinned_by[seq_id] if b != block])
        sliding = self._sliding_of.pop(block, None)
        if sliding is not None:
            del self._pool_of[sliding]
            self._idle.pop(block, None)
            self._free.append(sliding)

    def clear_idle(self) -> None:
        """Frees every idle sliding block (the prefix cache was cleared)."""
        for block in list(self._idle):
            self._detach(block)

    # ---- internals -----------------------------------------------------------------------

    def _pin(self, seq_id: str, block: int) -> None:
        holders = self._pins.setdefault(block, set())
        holders.add(seq_id)
        self._idle.pop(block, None)

    def _unpin(self, seq_id: str, block: int) -> None:
        holders = self._pins[block]
        holders.discard(seq_id)
        if not holders:
            del self._pins[block]
            if block in self._sliding_of:
                self._idle[block] = None

    def _attach(self, block: int, protect: Sequence[int] = ()) -> None:
        if not self._free:
            victim = next(idle for idle in self._idle if idle not in protect)
            self._detach(victim)
            self.reclaimed += 1
        sliding = self._free.pop()
        self._sliding_of[block] = sliding
        self._pool_of[sliding] = block

    def _detach(self, block: int) -> None:
        sliding = self._sliding_of.pop(block)
        del self._pool_of[sliding]
        self._idle.pop(block, None)
        self._free.append(sliding)

    def check_invariants(self, tables: dict[str, Sequence[int]] | None = None) -> None:
        """Every sliding block in exactly one state; pins agree with the sequences' pin
        lists; with `tables` (each sequence's pool table), every pinned block is in its
        pinning sequences' tables."""
        attached = set(self._pool_of)
        free = set(self._free)
        if len(free) != len(self._free) or attached & free or len(attached) + len(free) != self.num_blocks:
            raise AssertionError("a sliding block is not in exactly one of attached and free")
        if {self._sliding_of[block] for block in self._sliding_of} != attached or any(
                self._pool_of[s] != b for b, s in self._sliding_of.items()):
            raise AssertionError("attachments are not one to one")
        counted: dict[int, set[str]] = {}
        for seq_id, blocks in self._pinned_by.items():
            if not blocks or len(set(blocks)) != len(blocks):
                raise AssertionError(f"{seq_id}'s pin list is empty or repeats a block")
            for block in blocks:
                counted.setdefault(block, set()).add(seq_id)
                if tables is not None and block not in tables.get(seq_id, ()):
                    raise AssertionError(f"{seq_id} pins block {block} outside its table")
        if counted != self._pins:
            raise AssertionError("pin counts disagree with the sequences' pin lists")
        if any(block not in self._sliding_of for block in self._pins):
            raise AssertionError("a pinned pool block has no sliding block")
        if set(self._idle) != set(self._sliding_of) - set(self._pins):
            raise AssertionError("idle blocks are not exactly the attached, unpinned ones")
