"""The paged KV cache's device tensors: K and V per owning layer, allocated once for
every block; a token's slot is block_id * block_size + offset. Which block holds what
is block_pool.py's bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerKVSpec:
    """Shape of one layer's cache; a layer that reads another layer's cache owns none."""
    num_kv_heads: int
    head_dim: int



class PagedKVCache:
    """K and V tensors [num_blocks * block_size, kv_heads, head_dim] per owning layer,
    allocated once. A token's slot is block_id * block_size + offset."""

    def __init__(self, specs: Sequence[LayerKVSpec | None], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        slots = num_blocks * block_size
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        for spec in specs:
            if spec is None:
                self.keys.append(None)
                self.values.append(None)
                continue
            shape = (slots, spec.num_kv_heads, spec.head_dim)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))
        self.block_size = block_size
        self.device = device

    def copy_slots(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        """Copies the K/V of the first `num_tokens` slots of `src_block` into `dst_block`."""
        src = slice(src_block * self.block_size, src_block * self.block_size + num_tokens)
        dst = slice(dst_block * self.block_size, dst_block * self.block_size + num_tokens)
        for cache in (*self.keys, *self.values):
            if cache is not None:
                cache[dst] = cache[src]

    @staticmethod
    def bytes_per_block(specs: Sequence[LayerKVSpec | None], block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        per_token = sum(2 * s.num_kv_heads * s.head_dim for s in specs if s is not None)
        return per_token * block_size * element
