"""Gemma 3's text decoder as plain torch modules, for the direct forward (no transformers).

transformers' model classes bring their library along: importing Gemma 3's modelling module
imports torch's compiler stack (`torch._dynamo`, sympy) and its distributed tensors, ~120 MB of
resident memory in every worker that only ever runs the direct forward
(cpu/direct_forward.py), which reads a model's modules and never calls their forwards past
the embedding, the norms, the MLP and the rotary embedding.

These classes hold the same parameters under the same names as transformers'
`Gemma3ForCausalLM` (so a checkpoint, a LoRA adapter's target names and every speed-up find
them where they look) and compute those four pieces exactly as transformers does, bit for
bit (tests/unit/worker/test_gemma3_text.py checks them against transformers' model). The
attention and decoder-layer modules carry what the direct forward reads (projections, norms,
`head_dim`, `scaling`, the sliding window, `layer_idx`) and have no forward of their own:
the direct forward is the only forward of this model (models/loader.py loads it only where
one serves).

    Gemma3ForCausalLM
    ├── model: Gemma3TextModel
    │   ├── embed_tokens  (lookup × sqrt(hidden))
    │   ├── layers[i]: Gemma3DecoderLayer
    │   │   ├── input_layernorm, post_attention_layernorm,
    │   │   │   pre_feedforward_layernorm, post_feedforward_layernorm
    │   │   ├── self_attn: q/k/v/o_proj, q_norm, k_norm
    │   │   └── mlp: gate/up/down_proj, act_fn (GELU, tanh)
    │   ├── norm
    │   └── rotary_emb (one inverse frequency per layer type)
    └── lm_head (the embedding's weight when tied)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.worker.engine.models.text_config import TextConfig

SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
Device = torch.device | str | None


class Gemma3TextScaledWordEmbedding(nn.Embedding):
    """The token embedding times sqrt(hidden_size), the scale rounded to the weight's dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None, embed_scale: float,
                 device: Device = None) -> None:
        # handed its (uninitialized) weight: no random init, which on the meta device imports torch's compiler
        super().__init__(num_embeddings, embedding_dim, padding_idx,
                         _weight=torch.empty(num_embeddings, embedding_dim, device=device))
        self.scalar_embed_scale = embed_scale
        self.register_buffer("embed_scale", torch.tensor(embed_scale, device="cpu"), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


class Gemma3RMSNorm(nn.Module):
    """RMSNorm in float32 with Gemma's (1 + weight) scale, cast back after the product."""

    def __init__(self, dim: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        floats = x.float()
        output = floats * torch.rsqrt(floats.pow(2).mean(-1, keepdim=True) + self.eps)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")


class Gemma3MLP(nn.Module):
    def __init__(self, config: TextConfig, device: Device = None) -> None:
        super().__init__()
        hidden, intermediate = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, device=device)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, device=device)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, device=device)
        self.act_fn = gelu_tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Gemma3RotaryEmbedding(nn.Module):
    """cos and sin of each position's angles, per layer type (local and global bases). Its
    buffers (and the embedding's scale) are made on the CPU wherever the parameters are: they
    are not in the checkpoint."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.layer_types = sorted(set(config.layer_types))
        for layer_type in self.layer_types:
            base = config.rope_parameters[layer_type]["rope_theta"]
            dim = config.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
            self.register_buffer(f"{layer_type}_inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = getattr(self, f"{layer_type}_inv_freq")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [batch, heads, T, head_dim] rotated by cos and sin [batch, T, head_dim]."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class Gemma3Attention(nn.Module):
    """The attention's weights and shape; the direct forward computes it (no forward here)."""

    def __init__(self, config: TextConfig, layer_idx: int, device: Device = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.head_dim = config.head_dim
        self.scaling = config.query_pre_attn_scalar ** -0.5
        self.is_sliding = self.layer_type == "sliding_attention"
        self.sliding_window = config.sliding_window if self.is_sliding else None
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False, device=device)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, device=device)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, device=device)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False, device=device)
        self.q_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps, device)
        self.k_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps, device)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer_idx: int, device: Device = None) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_idx, device)
        self.mlp = Gemma3MLP(config, device)
        self.input_layernorm = Gemma3RMSNorm(hidden, eps, device)
        self.post_attention_layernorm = Gemma3RMSNorm(hidden, eps, device)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(hidden, eps, device)
        self.post_feedforward_layernorm = Gemma3RMSNorm(hidden, eps, device)


class Gemma3TextModel(nn.Module):
    def __init__(self, config: TextConfig, device: Device = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Gemma3TextScaledWordEmbedding(config.vocab_size, config.hidden_size,
                                                          config.pad_token_id, config.hidden_size ** 0.5, device)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, index, device)
                                    for index in range(config.num_hidden_layers))
        self.norm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.rotary_emb = Gemma3RotaryEmbedding(config)


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_id: int | list[int] | None = None


class Gemma3ForCausalLM(nn.Module):
    """The decoder and its LM head, with the model methods the engine calls."""

    def __init__(self, config: TextConfig, generation: GenerationConfig | None = None, device: Device = None) -> None:
        """`device`: the parameters' (e.g. "meta", for weights loaded afterwards: nothing allocated
        or initialized); the buffers, which no checkpoint holds, are made on the CPU."""
        super().__init__()
        self.config = config
        self.generation_config = generation or GenerationConfig()
        self.model = Gemma3TextModel(config, device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def base_model(self) -> Gemma3TextModel:
        return self.model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_attn_implementation(self, name: str) -> None:
        """Nothing to switch: the direct forward calls the paged attention itself."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("this model runs through the direct forward only (cpu/direct_forward.py); "
                                  "MODEL_IMPL=transformers loads transformers' model")


def supports(config: TextConfig) -> str | None:
    """Why `config` is not a Gemma 3 text decoder these classes compute exactly, or None."""
    if config.model_type != "gemma3_text":
        return f"model type {config.model_type!r}"
    if config.get("hidden_activation") not in SUPPORTED_ACTIVATIONS:
        return f"activation {config.get('hidden_activation')!r}"
    if config.get("attention_bias") or config.get("use_bidirectional_attention"):
        return "attention bias or bidirectional attention"
    if config.get("attn_logit_softcapping") or config.get("final_logit_softcapping"):
        return "logit softcapping"
    if config.get("quantization_config"):
        return "quantized weights"
    types = config.get("layer_types") or []
    rope = config.get("rope_parameters") or {}
    if not types or any(not isinstance(rope.get(kind), dict) or rope[kind].get("rope_type") != "default"
                        for kind in set(types)):
        return "a RoPE other than the default one per layer type"
    return None
