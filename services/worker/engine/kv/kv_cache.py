"""The paged KV cache's device tensors: K and V per owning layer, allocated once for
every block; a token's slot is block_id * block_size + offset. Which block holds what
is block_pool.py's bookkeeping.

Under the hybrid layout (sliding_blocks.py) the layers fall in two groups: the full
group's caches have a slot for every pool block, the sliding group's (the layers with
a sliding window) one for every sliding block, a smaller number. Slots of one group
mean nothing to the other.
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



FULL_GROUP, SLIDING_GROUP = 0, 1


class PagedKVCache:
    """K and V tensors [num_blocks * block_size, kv_heads, head_dim] per owning layer,
    allocated once (a sliding-group layer's: [sliding_blocks * block_size, ...]). A
    token's slot is block_id * block_size + offset."""

    def __init__(self, specs: Sequence[LayerKVSpec | None], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, sliding: Sequence[bool] = (),
                 sliding_blocks: int = 0) -> None:
        self.group = [SLIDING_GROUP if index < len(sliding) and sliding[index] else FULL_GROUP
                      for index in range(len(specs))]
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        for spec, group in zip(specs, self.group):
            if spec is None:
                self.keys.append(None)
                self.values.append(None)
                continue
            slots = (sliding_blocks if group == SLIDING_GROUP else num_blocks) * block_size
            shape = (slots, spec.num_kv_heads, spec.head_dim)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))
        self.block_size = block_size
        self.device = device

    @property
    def hybrid(self) -> bool:
        return SLIDING_GROUP in self.group

    def copy_slots(self, src_block: int, dst_block: int, num_tokens: int, group: int = FULL_GROUP) -> None:
        """Copies the K/V of the first `num_tokens` slots of `src_block` into `dst_block`,
        in the layers of `group` (blocks of that group's numbering)."""
        src = slice(src_block * self.block_size, src_block * self.block_size + num_tokens)
        dst = slice(dst_block * self.block_size, dst_block * self.block_size + num_tokens)
        for layer, group_of in enumerate(self.group):
            if group_of == group and self.keys[layer] is not None:
                for cache in (self.keys[layer], self.values[layer]):
                    cache[dst] = cache[src]

    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in (*self.keys, *self.values) if cache is not None)

    @staticmethod
    def bytes_per_block(specs: Sequence[LayerKVSpec | None], block_size: int, dtype: torch.dtype,
                        layers: Sequence[bool] | None = None) -> int:
        """Bytes of one block's K/V over the layers of `specs` (those `layers` marks, if given)."""
        element = torch.empty((), dtype=dtype).element_size()
        per_token = sum(2 * s.num_kv_heads * s.head_dim for index, s in enumerate(specs)
                        if s is not None and (layers is None or layers[index]))
        return per_token * block_size * element
