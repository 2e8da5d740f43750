"""Taking back a failed step's lossy-KV drops (kv_policy.py).

A lossy sequence drops blocks while its chunk is planned, before the forward: the blocks
leave its table and the keys after them are rotated to their new positions. Should the
step then fail (isolation.py rolls its sequences back to the mark and runs the work again
in halves), the sequence must keep what it had, or it would lose tokens for a chunk it
never computed. So until the step commits, what each drop did is kept here: the table
before it, the key shifts, and the dropped blocks themselves, parked under a pool table
of their own so that no allocation of the step can reuse them (their K/V stays intact).

settle  the step committed: the parked blocks go back to the pool.
undo    the step failed: the moved keys are rotated back (exact up to the cache dtype's
        rounding: float32 caches to about 1e-7) and the sequence gets its blocks back, in
        their places, followed by whatever the step allocated after the drop (which the
        isolation's roll back then shrinks away). Its counters (evicted tokens, h2o scores)
        are the isolation mark's to restore.

A parked table takes references through `allocate(..., cached_blocks=...)` and gives them
back through `free` (under EVICTION_POLICY=lfu that counts as a reuse of those blocks, a
small bias on the failure path alone); the sequence's table is put back in place
(`BlockPool.replace_table`), so the sliding group's pins on its window stay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.worker.engine.kv.block_pool import BlockPool
from services.worker.engine.kv.kv_rotation import KeyRotation

PARKED = "\x00dropped:"     # pool table ids of parked blocks: no sequence id holds a NUL


@dataclass
class Drop:
    """One drop under way or made: filled in as its parts are done."""
    seq_id: str
    table: tuple[int, ...]      # the sequence's table before the drop
    dropped: int                # how many of its blocks go
    parked: str                 # the pool table holding them meanwhile
    shifts: list[tuple[torch.Tensor, int]] = field(default_factory=list)   # (pool slots, moved back by), done
    taken: bool = False         # the blocks are out of the sequence's table


class DropJournal:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._drops: list[Drop] = []

    def dropped_blocks(self) -> int:
        """Blocks taken out of tables since the last settle."""
        return sum(drop.dropped for drop in self._drops if drop.taken)

    def park(self, seq_id: str, table: list[int], victims: list[int]) -> Drop:
        """Before `seq_id` drops the blocks at table indices `victims`: parks them; the caller
        notes on the returned Drop each part it then does."""
        blocks = [table[index] for index in victims]
        parked = f"{PARKED}{seq_id}:{len(self._drops)}"
        if not self.pool.allocate(parked, len(blocks) * self.pool.block_size, cached_blocks=blocks):
            raise AssertionError("parking referenced blocks needs no new block")
        drop = Drop(seq_id, tuple(table), len(blocks), parked)
        self._drops.append(drop)
        return drop

    def settle(self) -> None:
        """The step committed: the dropped blocks are free."""
        for drop in self._drops:
            self.pool.free(drop.parked)
        self._drops.clear()

    def undo(self, rotation: KeyRotation | None) -> None:
        """The step failed: every drop since the last settle is taken back, latest first."""
        while self._drops:
            drop = self._drops.pop()
            if rotation is not None:
                for slots, delta in reversed(drop.shifts):
                    rotation.shift(slots, -delta)
            if drop.taken:
                self._give_back(drop)
            self.pool.free(drop.parked)

    def _give_back(self, drop: Drop) -> None:
        now = list(self.pool.table(drop.seq_id))
        self.pool.replace_table(drop.seq_id, [*drop.table, *now[len(drop.table) - drop.dropped:]])
