"""Which kernel runs a step's prefill chunks' attention (ATTENTION_BACKEND).

`auto`: flash-attn's varlen call on CUDA in float16/bfloat16 when the package imports
(cuda/varlen_attention.py), the native C kernel on CPU in float32 when it builds and passes its
start-up check (cpu/native_prefill.py), else SDPA per chunk. `sdpa` never uses a fused kernel;
`flash_attn` and `native` require theirs and refuse to start without it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.worker.engine.cpu.native_prefill import load_native_prefill
from services.worker.engine.cuda.varlen_attention import VarlenKernel, load_varlen_kernel

BACKENDS = ("auto", "sdpa", "flash_attn", "native")


def load_prefill_kernel(backend: str, device: torch.device, dtype: torch.dtype,
                        cache_dir: Path | None = None) -> VarlenKernel | None:
    """The fused kernel `backend` asks for on this device and dtype, or None for SDPA per chunk.
    Raises ValueError for an unknown backend or a required kernel that cannot run here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "native" and device.type != "cpu":
        raise ValueError(f"ATTENTION_BACKEND=native needs CPU float32, not {device.type} {dtype}")
    if device.type == "cpu" and backend in ("auto", "native"):
        return load_native_prefill(backend, dtype, cache_dir)
    return load_varlen_kernel(backend, device, dtype)
