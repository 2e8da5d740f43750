"""Fused variable-length attention for prefill chunks (flash-attn, when installed).

Without it every prefill chunk in a step is its own SDPA call, and a chunk that
continues a sequence or runs under a sliding window needs a materialized
[chunk, context] mask. `flash_attn_varlen_func` takes all chunks of a step in
one call over packed queries and keys (`cu_seqlens`), with causal masking
aligned to the bottom right (a chunk's queries are the last rows of its
context) and sliding windows natively, so no mask is built.

ATTENTION_BACKEND picks it: `auto` uses flash-attn on CUDA in float16/bfloat16
when the package imports, `flash_attn` requires it, `sdpa` never uses it.
Layers whose head dimension the kernel does not support (over 256 for
flash-attn 2, e.g. Gemma 4's global layers) keep the SDPA path.

The contract it is called with, and its SDPA reference, are the core's (../varlen.py).
"""

from __future__ import annotations

import torch

from services.worker.engine.step.varlen import VarlenFunction, VarlenKernel

BACKENDS = ("auto", "sdpa", "flash_attn")
FLASH_ATTN_MAX_HEAD_DIM = 256


def import_flash_attn() -> VarlenFunction | None:
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - missing, or built for another torch/CUDA
        return None
    return flash_attn_varlen_func


def load_varlen_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> VarlenKernel | None:
    """The kernel `backend` asks for on this device and dtype, or None for the SDPA path.
    Raises ValueError when `flash_attn` is required but cannot run here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "sdpa":
        return None
    fits = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    function = import_flash_attn() if fits else None
    if function is None:
        if backend == "flash_attn":
            reason = ("the flash_attn package does not import" if fits
                      else f"it needs CUDA and float16/bfloat16, not {device.type} {dtype}")
            raise ValueError(f"ATTENTION_BACKEND=flash_attn cannot be used: {reason}")
        return None
    return VarlenKernel("flash_attn", function, FLASH_ATTN_MAX_HEAD_DIM)
