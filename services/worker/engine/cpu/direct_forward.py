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

from services.worker.engine.step.attention import StepMetadata, paged_attention_forward
from services.worker.engine.cpu.kernels.native_layers import NativeDecodeLayers
from services.worker.engine.cpu.kernels.native_ops import NativeElementwise
from services.worker.engine.lora.layers import LoraStep

Rope = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ROPE_TOLERANCE = 1e-5      # native RoPE against transformers', relative to the probe's largest output


@dataclass(frozen=True)
class LayerShape:
    attention: str           # the attention module class whose forward is written out here
    qk_norms: bool           # q_norm / k_norm over each head before the rotary embedding
    sandwich_norms: bool     # Gemma's norms after attention and MLP, before the residual adds
    rotary_per_type: bool    # one rotary embedding per layer type (Gemma 3's local and global bases)


Forward = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _LayerSteps:
    """One decoder layer's submodules as bound `forward`s, looked up once (a module
    attribute read goes through `Module.__getattr__`: ~500 of them a step otherwise)."""
    attention: torch.nn.Module
    head_dim: int
    scaling: float
    window: int | None
    input_norm: Forward
    q_proj: Forward
    k_proj: Forward
    v_proj: Forward
    o_proj: Forward
    q_norm: Forward | None
    k_norm: Forward | None
    post_attention_norm: Forward | None
    pre_mlp_norm: Forward
    mlp: Forward
    post_mlp_norm: Forward | None

    @classmethod
    def of(cls, layer: torch.nn.Module, shape: LayerShape) -> _LayerSteps:
        attn = layer.self_attn
        sandwich = shape.sandwich_norms
        return cls(
            attention=attn, head_dim=attn.head_dim, scaling=attn.scaling,
            window=getattr(attn, "sliding_window", None),
            input_norm=layer.input_layernorm.forward,
            q_proj=attn.q_proj.forward, k_proj=attn.k_proj.forward, v_proj=attn.v_proj.forward,
            o_proj=attn.o_proj.forward,
            q_norm=attn.q_norm.forward if shape.qk_norms else None,
            k_norm=attn.k_norm.forward if shape.qk_norms else None,
            post_attention_norm=layer.post_attention_layernorm.forward if sandwich else None,
            pre_mlp_norm=(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm).forward,
            mlp=layer.mlp.forward,
            post_mlp_norm=layer.post_feedforward_layernorm.forward if sandwich else None)


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
        layers = list(base.layers[:base.config.num_hidden_layers])
        types = getattr(base.config, "layer_types", None)
        self._layer_types: list[str | None] = list(types) if shape.rotary_per_type else [None] * len(layers)
        self._steps = [_LayerSteps.of(layer, shape) for layer in layers]
        self.native_layers: NativeDecodeLayers | None = None     # a few-row step's layers in one C call
        self._lora: LoraStep | None = None

    def serve_loras(self, step: LoraStep) -> None:
        """Re-reads the layers' projections (now LoRA wrappers, lora/layers.py); the C decode layers
        add the adapters' updates themselves (native_lora.py), given the projections' names."""
        self._lora = step
        layers = list(self._base.layers[:self._base.config.num_hidden_layers])
        self._steps = [_LayerSteps.of(layer, self._shape) for layer in layers]
        if self.native_layers is not None:
            self.native_layers.serve_loras([(layer.self_attn.q_proj.name, layer.self_attn.k_proj.name,
                                             layer.self_attn.v_proj.name, layer.self_attn.o_proj.name,
                                             layer.mlp.gate_proj.name, layer.mlp.up_proj.name,
                                             layer.mlp.down_proj.name) for layer in layers])

    @property
    def layer_types(self) -> list[str | None]:
        return self._layer_types

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

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states [T, hidden] of the packed rows `input_ids` [T] at `positions` [T];
        with `keep` (row indices), [len(keep), hidden] of those rows, in that order.

        Only the final norm and the LM head read the last layer's output, and a step reads it
        for the rows that sample (a decode row, the last row of a prompt): the other rows of a
        prefill chunk need from the last layer only their keys and values, which later steps
        attend to. So with `keep` the last layer writes every row's keys and values, as any
        layer does, and runs its output projection, MLP and norms on the kept rows alone
        (~80 % of that layer's multiply-adds on the default model, ~4.5 % of a long prompt's).

            rows of the step:     r0  r1  r2 ... r(T-1)
            layers 0 .. L-2:      every row
            layer L-1 attention:  every row (keys and values written to the cache)
            layer L-1 o_proj/MLP: kept rows only (e.g. r(T-1), the prompt's last)
        """
        base = self._base
        hidden = base.embed_tokens(input_ids[None])
        position_ids = positions[None]
        if self._shape.rotary_per_type:
            rotary = {kind: base.rotary_emb(hidden, position_ids, kind) for kind in set(self._layer_types)}
        else:
            rotary = {None: base.rotary_emb(hidden, position_ids)}
        layers = self.native_layers
        lora = self._lora.rows if self._lora is not None else None
        if layers is not None and (lora is None or layers.serves_loras) and layers.takes(meta, hidden.shape[1]):
            flat = hidden[0].contiguous()
            return base.norm(layers(flat, rotary, meta, lora, keep=keep)[None])[0]
        keep_last = keep if lora is None else None   # adapters group the step's rows: every row runs
        last = len(self._steps) - 1
        for index, (steps, layer_type) in enumerate(zip(self._steps, self._layer_types)):
            hidden = self._layer(steps, hidden, rotary[layer_type], meta, keep_last if index == last else None)
        out = base.norm(hidden)[0]
        return out if keep is None or keep_last is not None else out[keep]

    def _layer(self, steps: _LayerSteps, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
               meta: StepMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layer's forward: pre-norm attention and MLP, each added to the
        residual (Gemma: each output normed once more before the add); past the attention,
        the rows `keep` only (None: every row)."""
        residual = hidden if keep is None else hidden[:, keep]
        hidden = self._attention(steps, steps.input_norm(hidden), rotary, meta, keep)
        if residual.shape[1] == 0:
            return residual       # no row samples: the layer was run for its keys and values
        if steps.post_attention_norm is not None:
            hidden = steps.post_attention_norm(hidden)
        hidden = residual + hidden
        residual = hidden
        hidden = steps.mlp(steps.pre_mlp_norm(hidden))
        if steps.post_mlp_norm is not None:
            hidden = steps.post_mlp_norm(hidden)
        return residual + hidden

    def _attention(self, steps: _LayerSteps, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                   meta: StepMetadata, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The attention module's forward for the packed [1, T, hidden] rows (every row's keys
        and values cached), output-projected for the rows `keep` only (None: every row)."""
        shape = (*x.shape[:-1], -1, steps.head_dim)
        query = steps.q_proj(x).view(shape)        # [1, T, heads, head_dim]
        key = steps.k_proj(x).view(shape)
        value = steps.v_proj(x).view(shape)
        if steps.q_norm is not None and steps.k_norm is not None:
            query = steps.q_norm(query)
            key = steps.k_norm(key)
        cos, sin = rotary
        if self._native is not None and query.is_contiguous() and key.is_contiguous():
            self._native.rope(query[0], key[0], cos, sin)
            query, key = query.transpose(1, 2), key.transpose(1, 2)
        else:
            query, key = self._rope(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        out, _ = paged_attention_forward(steps.attention, query, key, value.transpose(1, 2), None,
                                         scaling=steps.scaling, dropout=0.0, sliding_window=steps.window,
                                         paged_metadata=meta)
        out = out.reshape(*x.shape[:-1], -1)
        if keep is not None and keep.numel() == 0:
            return out[:, :0]
        return steps.o_proj(out if keep is None else out[:, keep])


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
