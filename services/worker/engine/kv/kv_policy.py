"""Lossy KV policies on the paged pool (KV_POLICY, a request's kv_policy): what a
sequence's cache keeps once it holds its budget, so that it runs in bounded memory,
past what the pool could hold in full and past the model's trained context.

window  the most recent blocks (the StreamingLLM paper's baseline);
sink    the first blocks (the attention sinks: ceil(sink_tokens / block_size) of them)
        plus the most recent;
h2o     the most recent half of the budget plus, in the other half, the blocks with the
        largest attention accumulated over the steps (heavy hitters; h2o_scores.py).

Everything is block granular: the budget and the sinks are whole blocks, and a block is
dropped whole. Before a chunk is computed, the sequence drops as many full blocks as the
chunk needs room for (the partial last block and the sinks are never dropped), and a
chunk is cut to what the budget can hold with the protected blocks. The blocks after a
dropped one move up in the block table, and their keys are rotated to their new,
earlier positions (kv_rotation.py): positions are always contiguous within the cache,
as StreamingLLM assigns them. A lossy sequence neither reuses nor publishes cached
blocks: what its blocks hold depends on what it dropped. A drop is taken back when its
step fails (drop_journal.py): the engine settles or undoes the evictor's drops after
each attempt at a step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.step import KV_POLICIES, KvPolicy
from services.worker.engine.kv.block_pool import BlockPool
from services.worker.engine.kv.drop_journal import DropJournal
from services.worker.engine.kv.kv_rotation import KeyRotation

if TYPE_CHECKING:
    from services.worker.engine.step.sequences import SequenceState



@dataclass(frozen=True)
class BlockBudget:
    kind: str
    blocks: int             # the cache's size, in blocks
    sink_blocks: int        # leading blocks never dropped
    recent_blocks: int      # trailing blocks never dropped (h2o; window and sink keep the newest anyway)


def policy_error(policy: KvPolicy) -> str:
    """Why `policy` cannot be served ("" when it can)."""
    if policy.kind not in KV_POLICIES:
        return f"unknown KV policy {policy.kind!r}; expected one of {', '.join(KV_POLICIES)}"
    if policy.lossy and policy.budget_tokens <= 0:
        return f"KV policy {policy.kind} needs a budget of at least one token, got {policy.budget_tokens}"
    if policy.sink_tokens < 0:
        return f"sink tokens must be >= 0, got {policy.sink_tokens}"
    return ""


def block_budget(policy: KvPolicy, block_size: int) -> BlockBudget | None:
    """`policy` in blocks (None for "full"); a budget too small for its sinks and a block
    to drop grows to the smallest that works."""
    if not policy.lossy:
        return None
    sink = policy.sink_blocks(block_size)
    blocks = policy.cache_blocks(block_size)
    recent = max(1, blocks // 2) if policy.kind == "h2o" else 0
    return BlockBudget(policy.kind, blocks, sink, recent)


class KvEvictor:
    def __init__(self, pool: BlockPool, rotation: KeyRotation | None, block_size: int) -> None:
        self.pool = pool
        self.rotation = rotation
        self.block_size = block_size
        self.evicted_blocks = 0
        self.journal = DropJournal(pool)

    def settle(self) -> None:
        """The step computed: its drops stand."""
        self.journal.settle()

    def undo(self) -> None:
        """The step failed: its drops are taken back (the isolation restores the counters)."""
        self.evicted_blocks -= self.journal.dropped_blocks()
        self.journal.undo(self.rotation)

    def make_room(self, seq: SequenceState, num_tokens: int) -> int:
        """Drops `seq`'s blocks until a chunk of up to `num_tokens` tokens fits its budget;
        returns how many of them it can compute now (at least one)."""
        budget = seq.budget
        assert budget is not None
        size = self.block_size
        cache_len = seq.cache_len
        full, tail = divmod(cache_len, size)
        sink = min(budget.sink_blocks, full)
        protected = cache_len if full < budget.sink_blocks else sink * size + tail
        count = max(1, min(num_tokens, budget.blocks * size - protected))
        over = cache_len + count - budget.blocks * size
        if over > 0:
            self._drop(seq, self._victims(seq, budget, list(range(sink, full)), -(-over // size)))
        return count

    def _victims(self, seq: SequenceState, budget: BlockBudget, candidates: list[int], count: int) -> list[int]:
        """Which `count` of the droppable blocks (table indices, oldest first) go."""
        if budget.kind != "h2o":
            return candidates[:count]
        recent = min(budget.recent_blocks, len(candidates))
        heavy = candidates[:len(candidates) - recent]
        scores = seq.block_scores
        ranked = sorted(heavy, key=lambda index: (scores[index] if index < len(scores) else 0.0, index))
        chosen = ranked[:count]
        if len(chosen) < count:    # the recent part too, oldest first
            chosen += candidates[len(heavy):len(heavy) + count - len(chosen)]
        return sorted(chosen)

    def _drop(self, seq: SequenceState, victims: list[int]) -> None:
        if self.rotation is None:
            raise RuntimeError("this model's cached keys cannot be moved: lossy KV policies are not served")
        table = self.pool.table(seq.seq_id)
        size = self.block_size
        by_shift: dict[int, list[int]] = defaultdict(list)
        gone = 0
        for index in range(victims[0], len(table)):
            if gone < len(victims) and victims[gone] == index:
                gone += 1
            elif gone:
                by_shift[gone].append(table[index])
        device = self.rotation.kv.device
        drop = self.journal.park(seq.seq_id, table, victims)   # taken back if the step fails
        for shift, blocks in by_shift.items():
            slots = (torch.tensor(blocks)[:, None] * size + torch.arange(size)[None, :]).reshape(-1).to(device)
            self.rotation.shift(slots, shift * size)
            drop.shifts.append((slots, shift * size))
        self.pool.drop(seq.seq_id, victims)
        drop.taken = True
        if seq.block_scores:
            dropped = set(victims)
            seq.block_scores = [score for index, score in enumerate(seq.block_scores) if index not in dropped]
        seq.evicted += len(victims) * size
        self.evicted_blocks += len(victims)
