"""The base model's forward without transformers' per-module dispatch (CPU).

A decode step of a small model spends a good part of its time outside the
matmuls: the model's forward and each decoder layer's and attention module's go
through `Module.__call__`, keyword-argument plumbing, deprecation and
output-capturing wrappers, the attention-interface lookup and config attribute
reads, and the rotary embedding is ten small tensor ops per layer. On CUDA the
decode graphs remove all of it; on CPU it is paid every step, the same at batch 1
as at batch 32.

`DirectForward` runs the same computation from the same modules: the embedding,
rotary embedding, norm, linear and MLP modules are called as they are (our fused
swaps included), the attention goes straight to the paged attention function,
and the glue between them is the decoder layer's own forward written out for the
layer classes in `LAYERS`. A model with any other layer class keeps transformers'
forward (`create` returns None).

The heads stay in the projections' [T, heads, head_dim] layout throughout (the
attention function gets them as transposed views), so the q/k norms and the
rotary embedding work on contiguous rows. With the engine's C ops, the rotary
embedding of a layer's query and key heads is one in-place C pass
(`NativeElementwise.rope`, used only if it agrees with transformers' RoPE on a
probe to float32 rounding); without them it is transformers' own function, and
the hidden states are bitwise transformers' (the tests check both).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.worker.engine.attention import StepMetadata, paged_attention_forward
from services.worker.engine.native_ops import NativeElementwise

Rope = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ROPE_TOLERANCE = 1e-5      # native RoPE against transformers', relative to the probe's largest output


@dataclass(frozen=True)
class LayerShape:
    attention: str           # the attention module class whose forward is written out here
    qk_norms: bool           # q_norm / k_norm over each head before the rotary embedding
    sandwich_norms: bool     # Gemma's norms after attention and MLP, before the residual adds
    rotary_per_type: bool    # one rotary embedding per layer type (Gemma 3's local and global bases)


LAYERS = {
    "Gemma3DecoderLayer": LayerShape("Gemma3Attention", qk_norms=True, sandwich_norms=True, rotary_per_type=True),
    "LlamaDecoderLayer": LayerShape("LlamaAttention", qk_norms=False, sandwich_norms=False, rotary_per_type=False),
    "Qwen2DecoderLayer": LayerShape("Qwen2Attention", qk_norms=False, sandwich_norms=False, rotary_per_type=False),
    "Qwen3DecoderLayer": LayerShape("Qwen3Attention", qk_norms=True, sandwich_norms=False, rotary_per_type=False),
}


class DirectForward:
    def __init__(self, base: torch.nn.Module, shape: LayerShape, rope: Rope,
                 native: NativeElementwise | None) -> None:
        self._base = base
        self._shape = shape
        self._rope = rope
        self._native = native
        config = base.config
        self._layers = list(base.layers[:config.num_hidden_layers])
        types = getattr(config, "layer_types", None)
        self._layer_types: list[str | None] = (list(types) if shape.rotary_per_type
                                               else [None] * len(self._layers))
        self._heads = [(layer.self_attn.head_dim, layer.self_attn.scaling,
                        getattr(layer.self_attn, "sliding_window", None)) for layer in self._layers]

    @property
    def native_rope(self) -> bool:
        return self._native is not None

    @classmethod
    def create(cls, base: torch.nn.Module, native: NativeElementwise | None = None) -> DirectForward | None:
        """A direct forward for `base` (the text decoder), or None when its layers are not
        one of the classes written out here. `native`: the C ops, for the rotary embedding
        (float32 CPU models only, and only if its probe agrees)."""
        layers = getattr(base, "layers", None)
        if layers is None or not all(hasattr(base, name) for name in ("embed_tokens", "norm", "rotary_emb")):
            return None
        layers = list(layers[:base.config.num_hidden_layers])
        names = {type(layer).__name__ for layer in layers}
        shape = LAYERS.get(names.pop()) if len(names) == 1 else None
        if shape is None or any(type(layer.self_attn).__name__ != shape.attention for layer in layers):
            return None
        if shape.rotary_per_type and not getattr(base.config, "layer_types", None):
            return None
        rope = getattr(sys.modules[type(layers[0]).__module__], "apply_rotary_pos_emb", None)
        if rope is None:
            return None
        weight = layers[0].self_attn.q_proj.weight
        if native is not None and not (weight.dtype == torch.float32 and weight.device.type == "cpu"
                                       and _native_rope_agrees(native, rope, layers[0].self_attn.head_dim)):
            native = None
        return cls(base, shape, rope, native)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """Last hidden states [T, hidden] of the packed rows `input_ids` [T] at `positions` [T]."""
        base = self._base
        hidden = base.embed_tokens(input_ids[None])
        position_ids = positions[None]
        if self._shape.rotary_per_type:
            rotary = {kind: base.rotary_emb(hidden, position_ids, kind) for kind in set(self._layer_types)}
        else:
            rotary = {None: base.rotary_emb(hidden, position_ids)}
        for index, layer in enumerate(self._layers):
            hidden = self._layer(index, layer, hidden, rotary[self._layer_types[index]], meta)
        return base.norm(hidden)[0]

    def _layer(self, index: int, layer: torch.nn.Module, hidden: torch.Tensor,
               rotary: tuple[torch.Tensor, torch.Tensor], meta: StepMetadata) -> torch.Tensor:
        """The decoder layer's forward: pre-norm attention and MLP, each added to the
        residual (Gemma: each output normed once more before the add)."""
        sandwich = self._shape.sandwich_norms
        residual = hidden
        hidden = self._attention(index, layer.self_attn, layer.input_layernorm.forward(hidden), rotary, meta)
        if sandwich:
            hidden = layer.post_attention_layernorm.forward(hidden)
        hidden = residual + hidden
        residual = hidden
        norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        hidden = layer.mlp.forward(norm.forward(hidden))
        if sandwich:
            hidden = layer.post_feedforward_layernorm.forward(hidden)
        return residual + hidden

    def _attention(self, index: int, attn: torch.nn.Module, x: torch.Tensor,
                   rotary: tuple[torch.Tensor, torch.Tensor], meta: StepMetadata) -> torch.Tensor:
        """The attention module's forward for the packed [1, T, hidden] rows."""
        head_dim, scaling, window = self._heads[index]
        shape = (*x.shape[:-1], -1, head_dim)
        query = attn.q_proj.forward(x).view(shape)        # [1, T, heads, head_dim]
        key = attn.k_proj.forward(x).view(shape)
        value = attn.v_proj.forward(x).view(shape)
        if self._shape.qk_norms:
            query = attn.q_norm.forward(query)
            key = attn.k_norm.forward(key)
        cos, sin = rotary
        if self._native is not None and query.is_contiguous() and key.is_contiguous():
            self._native.rope(query[0], key[0], cos, sin)
            query, key = query.transpose(1, 2), key.transpose(1, 2)
        else:
            query, key = self._rope(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        out, _ = paged_attention_forward(attn, query, key, value.transpose(1, 2), None, scaling=scaling,
                                         dropout=0.0, sliding_window=window, paged_metadata=meta)
        return attn.o_proj.forward(out.reshape(*x.shape[:-1], -1))


def _native_rope_agrees(native: NativeElementwise, rope: Rope, head_dim: int) -> bool:
    """The C rotary embedding against the model's own on random heads and angles."""
    if head_dim % 2:
        return False
    generator = torch.Generator().manual_seed(0)
    rows, heads = 5, 3
    query = torch.randn(1, rows, heads, head_dim, generator=generator) * 4
    key = torch.randn(1, rows, 1, head_dim, generator=generator)
    angles = torch.rand(1, rows, head_dim // 2, generator=generator) * 1000
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    with torch.no_grad():
        expected_q, expected_k = rope(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    got_q, got_k = query[0].clone(), key[0].clone()
    native.rope(got_q, got_k, cos, sin)
    for got, expected in ((got_q, expected_q[0].transpose(0, 1)), (got_k, expected_k[0].transpose(0, 1))):
        if not bool(((got - expected).abs() <= ROPE_TOLERANCE * expected.abs().max()).all()):
            return False
    return True
