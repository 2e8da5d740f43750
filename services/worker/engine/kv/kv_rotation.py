"""Moving cached keys to earlier positions: what a lossy KV policy (kv_policy.py) does to
the blocks after the ones it drops, so that positions stay contiguous within the cache
(StreamingLLM's choice: a sequence's cache is attended to as if it had only ever held
what it holds now).

The cache stores keys after RoPE. RoPE at position p rotates each pair of dimensions by
p * theta_i, and rotations compose, so a key stored at p is moved to p - delta by rotating
it once more by -delta: k' = k cos(delta theta) - rotate_half(k) sin(delta theta), the
model's own cos/sin at position delta (per layer type where it has several, as Gemma 3's
local and global bases), computed in float32 and written back in the cache's dtype.
Values carry no position and stay as they are.
"""

from __future__ import annotations

import inspect

import torch

from services.worker.engine.kv.kv_cache import SLIDING_GROUP, PagedKVCache
from services.worker.engine.kv.sliding_blocks import SlidingBlocks


class KeyRotation:
    @staticmethod
    def of(base: torch.nn.Module, kv: PagedKVCache, sliding: SlidingBlocks | None = None) -> KeyRotation | None:
        """The rotation of `base`'s keys, or None for a model without a rotary embedding."""
        if not isinstance(getattr(base, "rotary_emb", None), torch.nn.Module):
            return None
        return KeyRotation(base, kv, sliding)

    def __init__(self, base: torch.nn.Module, kv: PagedKVCache, sliding: SlidingBlocks | None = None) -> None:
        self.rotary = base.rotary_emb
        self.kv = kv
        self.sliding = sliding
        types = getattr(base.config, "layer_types", None)
        takes_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.layer_types: list[str | None] = [
            types[layer] if types is not None and takes_type else None for layer in range(len(kv.keys))]
        self._cos_sin: dict[tuple[str | None, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def shift(self, slots: torch.Tensor, delta: int) -> None:
        """Moves the keys in `slots` (pool slots: every layer that owns a cache, the sliding
        group's layers where those blocks have sliding blocks) `delta` positions back."""
        if delta == 0 or slots.numel() == 0:
            return
        sliding_slots = self._sliding_slots(slots) if self.sliding is not None else slots
        for layer, keys in enumerate(self.kv.keys):
            layer_slots = sliding_slots if self.kv.group[layer] == SLIDING_GROUP else slots
            if keys is None or layer_slots.numel() == 0:
                continue
            cos, sin = self.cos_sin(self.layer_types[layer], delta, keys.device)
            k = keys.index_select(0, layer_slots).float()
            keys.index_copy_(0, layer_slots, (k * cos - _rotate_half(k) * sin).to(keys.dtype))

    def _sliding_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The sliding group's slots of the attached blocks among pool `slots`."""
        assert self.sliding is not None
        size = self.kv.block_size
        moved = [self.sliding.sliding_of(slot // size) * size + slot % size
                 for slot in slots.tolist() if self.sliding.attached(slot // size)]
        return torch.tensor(moved, dtype=torch.long, device=slots.device)

    def cos_sin(self, layer_type: str | None, position: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's RoPE cos and sin at `position` ([head_dim], float32)."""
        key = (layer_type, position)
        cached = self._cos_sin.get(key)
        if cached is None:
            probe = torch.zeros(1, 1, 1, dtype=torch.float32, device=device)
            positions = torch.tensor([[position]], device=device)
            with torch.no_grad():
                if layer_type is None:
                    cos, sin = self.rotary(probe, positions)
                else:
                    cos, sin = self.rotary(probe, positions, layer_type)
            cos, sin = cos.reshape(-1).float(), sin.reshape(-1).float()
            # Some RoPE variants scale cos and sin by an attention factor: a rotation is not.
            norm = torch.sqrt(cos * cos + sin * sin)
            cached = (cos / norm, sin / norm)
            self._cos_sin[key] = cached
        return cached


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
