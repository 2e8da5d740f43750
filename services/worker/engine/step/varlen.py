"""The fused varlen attention contract (flash-attn's `flash_attn_varlen_func`) that a step's
prefill chunks can be handed to: `VarlenKernel`, what a loaded kernel is, and
`reference_varlen_attention`, the same contract written with SDPA and explicit masks.

The core only calls a kernel it is handed (attention.py); the kernels themselves are device
speed-ups (cuda/varlen_attention.py: flash-attn; cpu/native_prefill.py: a C kernel, checked at
start-up against the reference), and the tests run the engine through the reference on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (q [total_q, H, d], k [total_k, KVH, d], v [total_k, KVH, dv], cu_seqlens_q, cu_seqlens_k,
#  max_seqlen_q, max_seqlen_k, softmax_scale=, causal=, window_size=(left, right)) -> [total_q, H, dv]
VarlenFunction = Callable[..., torch.Tensor]
# (q [total_q, H, d], k_cache [slots, KVH, d], v_cache [slots, KVH, dv], key_slots [total_k],
#  cu_seqlens_q, cu_seqlens_k, softmax_scale=, window=) -> [total_q, H, dv]: causal, each chunk's keys
#  read where the paged pool holds them (cpu/native_prefill.py).
PagedVarlenFunction = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class VarlenKernel:
    name: str
    function: VarlenFunction
    max_head_dim: int
    head_dim_multiple: int = 1          # head dimensions the kernel takes are multiples of this
    paged: PagedVarlenFunction | None = None   # the same kernel reading K/V through slots, if it can

    def supports(self, head_dim: int, value_dim: int) -> bool:
        return all(dim <= self.max_head_dim and dim % self.head_dim_multiple == 0 for dim in (head_dim, value_dim))


def reference_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                               softmax_scale: float | None = None, causal: bool = False,
                               window_size: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """flash_attn_varlen_func's documented semantics, one SDPA call per sequence.

    Query i of a sequence with seqlen_q queries and seqlen_k keys sees key j when
    j <= i + seqlen_k - seqlen_q (causal, bottom-right aligned) and, with a window
    (left, right), i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right
    (-1 = unbounded). A query that sees no key gets zeros. Heads of q sharing a KV
    head are consecutive (GQA/MQA)."""
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))
    q_bounds, k_bounds = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for index in range(len(q_bounds) - 1):
        q_start, q_end = q_bounds[index], q_bounds[index + 1]
        k_start, k_end = k_bounds[index], k_bounds[index + 1]
        if q_end == q_start:
            continue
        seqlen_q, seqlen_k = q_end - q_start, k_end - k_start
        query_index = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)
        key_index = torch.arange(seqlen_k, device=q.device)[None, :]
        visible = torch.ones((seqlen_q, seqlen_k), dtype=torch.bool, device=q.device)
        left, right = window_size
        if causal:
            right = 0
        if left >= 0:
            visible &= key_index >= query_index - left
        if right >= 0:
            visible &= key_index <= query_index + right
        rows = visible.any(dim=-1)
        attended = F.scaled_dot_product_attention(
            q[q_start:q_end].transpose(0, 1), k[k_start:k_end].transpose(0, 1), v[k_start:k_end].transpose(0, 1),
            attn_mask=visible, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        out[q_start:q_end] = torch.where(rows[:, None, None], attended.transpose(0, 1), 0.0)
    return out
