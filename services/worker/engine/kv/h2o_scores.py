"""Accumulated attention per cached block, for the h2o KV policy (kv_policy.py): at every
step a sequence under h2o computes, the attention its last row pays to each position of
its cache is added up over heads and layers, then over the positions of each block, into
the sequence's block_scores (one per block-table entry). The blocks with the largest sums
are the heavy hitters h2o keeps.

The weights are computed apart from the attention itself, from the query and the cached
keys each layer already has (softmax(q k^T * scale), a sliding layer's window masked), so
every attention kernel serves unchanged. The C decode layers, which never hand the query
back, do not take a step with an h2o sequence, and neither do CUDA decode graphs: such
steps run the per-layer path (the price of h2o, besides this extra product per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.worker.engine.step.sequences import SequenceState


@dataclass
class _Tracked:
    seq: SequenceState
    row: int                # its last row in the packed batch
    slots: torch.Tensor     # [L] slots of cache positions 0 .. L-1
    totals: torch.Tensor    # [L] float32, summed over heads and layers


class AttentionScores:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._tracked: list[_Tracked] = []

    def track(self, seq: SequenceState, row: int, slots: torch.Tensor) -> None:
        self._tracked.append(_Tracked(seq, row, slots, torch.zeros(slots.shape[0], dtype=torch.float32,
                                                                   device=slots.device)))

    def __bool__(self) -> bool:
        return bool(self._tracked)

    def observe(self, query: torch.Tensor, k_cache: torch.Tensor, scaling: float | None,
                window: int | None) -> None:
        """One layer: query [1, H, T, d] of the packed rows, after its keys are in `k_cache`."""
        heads, head_dim = query.shape[1], query.shape[3]
        scale = scaling if scaling is not None else head_dim ** -0.5
        for tracked in self._tracked:
            keys = k_cache.index_select(0, tracked.slots).float()          # [L, KVH, d]
            group = heads // keys.shape[1]
            q = query[0, :, tracked.row].float().view(keys.shape[1], group, head_dim)   # [KVH, G, d]
            logits = torch.einsum("kgd,lkd->kgl", q, keys) * scale
            if window is not None and window < keys.shape[0]:
                logits[..., :keys.shape[0] - window] = float("-inf")
            tracked.totals += torch.softmax(logits, dim=-1).sum(dim=(0, 1))

    def commit(self) -> None:
        """Adds each tracked sequence's per-position totals to its blocks' scores."""
        for tracked in self._tracked:
            blocks = -(-tracked.totals.shape[0] // self.block_size)
            per_block = torch.zeros(blocks, dtype=torch.float32, device=tracked.totals.device)
            index = torch.arange(tracked.totals.shape[0], device=tracked.totals.device) // self.block_size
            per_block.index_add_(0, index, tracked.totals)
            scores = tracked.seq.block_scores
            scores.extend([0.0] * (blocks - len(scores)))
            for block, value in enumerate(per_block.tolist()):
                scores[block] += value
        self._tracked.clear()
