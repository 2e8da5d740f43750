"""How large an engine's KV pool and context are: each layer's cache shape (and which
layer's cache a KV-shared layer reads), which layers keep the smaller sliding-window
cache (sliding_blocks.py), the default block counts from the memory left after the
weights, and the longest sequence served.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.engine.kv.kv_cache import LayerKVSpec, PagedKVCache
from services.worker.engine.config import EngineConfig
from services.worker.engine.device import free_device_memory

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def layer_kv_layout(base: torch.nn.Module) -> tuple[list[LayerKVSpec | None], list[int]]:
    """Cache shape per layer, and which layer's cache each layer reads: its own, or for
    a KV-shared layer (Gemma 4) the last earlier storing layer of the same attention type."""
    specs: list[LayerKVSpec | None] = []
    cache_layer: list[int] = []
    last_store: dict[object, int] = {}
    for index, layer in enumerate(base.layers):
        attn = layer.self_attn
        kind = getattr(attn, "layer_type", None)
        if getattr(attn, "is_kv_shared_layer", False):
            if kind not in last_store:
                raise ValueError(f"layer {index} shares KV but no earlier {kind} layer stores it")
            specs.append(None)
            cache_layer.append(last_store[kind])
            continue
        head_dim = int(attn.head_dim)
        specs.append(LayerKVSpec(num_kv_heads=attn.k_proj.out_features // head_dim, head_dim=head_dim))
        cache_layer.append(index)
        if getattr(attn, "store_full_length_kv", True):
            last_store[kind] = index
    return specs, cache_layer


@dataclass(frozen=True)
class KvLayout:
    num_blocks: int             # the pool's (every full-attention layer's cache)
    sliding_blocks: int         # the sliding group's; 0: no sliding group
    window: int | None          # the sliding group's window (the largest of its layers')
    sliding: list[bool]         # per layer: its cache is the sliding group's


def sliding_layers(base: torch.nn.Module, specs: list[LayerKVSpec | None]) -> tuple[int | None, list[bool]]:
    """The window of the cache-owning layers that attend through a sliding window (the
    largest, where they differ), and which layers those are; (None, []) when none does."""
    sliding: list[bool] = []
    windows: list[int] = []
    for layer, spec in zip(base.layers, specs):
        attn = layer.self_attn
        window = getattr(attn, "sliding_window", None) if getattr(attn, "is_sliding", None) is not False else None
        sliding.append(spec is not None and bool(window))
        if sliding[-1]:
            windows.append(int(window))
    return (max(windows), sliding) if windows else (None, [])


def kv_layout(base: torch.nn.Module, specs: list[LayerKVSpec | None], config: EngineConfig,
              device: torch.device, dtype: torch.dtype) -> KvLayout:
    """The pool's and the sliding group's block counts (call after loading the weights).
    Given KV_CACHE_NUM_BLOCKS, the sliding group gets as many blocks (nothing that fitted
    before stops fitting); sized from memory, it gets half the byte budget."""
    window, sliding = sliding_layers(base, specs) if config.kv_hybrid else (None, [])
    size = config.block_size
    if window is None:
        blocks = config.num_blocks or max(1, kv_budget(config, device) // PagedKVCache.bytes_per_block(
            specs, size, dtype))
        return KvLayout(blocks, 0, None, [])
    floor = window // size + 2      # one window's blocks, and one being written
    if 0 < config.sliding_blocks < floor:
        raise ValueError(f"KV_CACHE_SLIDING_BLOCKS must be at least {floor} (a {window}-token window "
                         f"in blocks of {size}), got {config.sliding_blocks}")
    if config.num_blocks:
        return KvLayout(config.num_blocks, config.sliding_blocks or config.num_blocks, window, sliding)
    budget = kv_budget(config, device)
    per_sliding = PagedKVCache.bytes_per_block(specs, size, dtype, sliding)
    per_full = PagedKVCache.bytes_per_block(specs, size, dtype, [not s for s in sliding])
    sliding_blocks = config.sliding_blocks or max(floor, budget // 2 // per_sliding)
    num_blocks = max(1, (budget - sliding_blocks * per_sliding) // (per_full or per_sliding))
    return KvLayout(num_blocks, min(sliding_blocks, num_blocks), window, sliding)


def kv_budget(config: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV caches: the configured share of free memory, or cpu_kv_bytes."""
    fraction = config.kv_memory_fraction
    if device.type == "cuda":
        return int(free_device_memory(device) * (fraction or 0.5))
    if fraction > 0:
        # After the weights are loaded, so the fraction is of what is left.
        return int(free_device_memory(device) * fraction)
    return config.cpu_kv_bytes


def max_model_len(config: EngineConfig, model_config: PretrainedConfig, device: torch.device) -> int:
    if config.max_model_len > 0:
        return config.max_model_len
    limit = int(getattr(model_config, "max_position_embeddings", 0) or config.cpu_max_model_len)
    if device.type != "cuda":
        limit = min(limit, config.cpu_max_model_len)
    return limit
