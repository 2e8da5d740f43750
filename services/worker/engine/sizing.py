"""How large an engine's KV pool and context are: each layer's cache shape (and which
layer's cache a KV-shared layer reads), the default block count from the memory
left after the weights, and the longest sequence served.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from services.worker.engine.kv_cache import LayerKVSpec, PagedKVCache
from services.worker.engine.config import EngineConfig
from services.worker.engine.device import free_device_memory


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


def default_num_blocks(specs: list[LayerKVSpec | None], config: EngineConfig, device: torch.device,
                       dtype: torch.dtype) -> int:
    """Blocks that fit the configured share of free memory (call after loading the weights)."""
    per_block = PagedKVCache.bytes_per_block(specs, config.block_size, dtype)
    fraction = config.kv_memory_fraction
    if device.type == "cuda":
        budget = int(free_device_memory(device) * (fraction or 0.5))
    elif fraction > 0:
        # After the weights are loaded, so the fraction is of what is left.
        budget = int(free_device_memory(device) * fraction)
    else:
        budget = config.cpu_kv_bytes
    return max(1, budget // per_block)


def max_model_len(config: EngineConfig, model_config: PretrainedConfig, device: torch.device) -> int:
    if config.max_model_len > 0:
        return config.max_model_len
    limit = int(getattr(model_config, "max_position_embeddings", 0) or config.cpu_max_model_len)
    if device.type != "cuda":
        limit = min(limit, config.cpu_max_model_len)
    return limit
