"""Prefill attention for all of a step's chunks in one C call, on CPU in float32.

Without it each prefill chunk is its own SDPA call. On a 2-core AMD EPYC, SDPA ran a
277-token chunk of the default model (4 query heads of 256 over one K/V head, causal) at
~66 GFLOP/s counting the causal half, a third of the layers' GEMM rate, and a chunk that
continues its sequence needs a materialized mask. `native/prefill_attention.c` takes the
chunks packed with flash-attn's varlen contract (`cu_seqlens`, causal aligned to the bottom
right, a sliding window), tiles each chunk's queries with the heads that share a K/V head as
extra rows, skips the blocks above the causal diagonal and runs an online softmax over key
blocks, so it needs no mask and no gathered copy per head.

It is compiled once per machine (`native_build.py`) and loaded with ctypes. On CPU in float32,
`ATTENTION_BACKEND=auto` uses it when it builds and its start-up check against a float64
reference passes, `native` requires it, `sdpa` never uses it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from services.worker.engine.cpu.kernels.native_build import NativeBuildError, default_cache_dir, load_library
from services.worker.engine.step.varlen import VarlenKernel, reference_varlen_attention

log = logging.getLogger(__name__)

# Head dimensions must be whole vectors of the widest build (AVX-512: 16 floats).
VECTOR_WIDTH = 16
# Any head dimension that is a multiple of VECTOR_WIDTH: the kernel holds no per-dimension state.
MAX_HEAD_DIM = 1 << 16
# A check mismatch beyond this relative error disables the kernel.
CHECK_TOLERANCE = 1e-4


class NativePrefillAttention:
    """ctypes binding of fairserve_prefill_attention, with flash_attn_varlen_func's signature."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.fairserve_prefill_attention
        function.restype = ctypes.c_int
        function.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 5
                             + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64])
        self._function = function
        paged = library.fairserve_prefill_attention_paged
        paged.restype = ctypes.c_int
        paged.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 6
                          + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64])
        self._paged = paged

    @property
    def paged_function(self) -> ctypes._CFuncPtr:
        """The paged entry itself, for native_layers.py to call from C."""
        return self._paged

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                 softmax_scale: float | None = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1)) -> torch.Tensor:
        """q [total_q, H, d] (any token and head strides, d contiguous), k [total_k, KVH, d],
        v [total_k, KVH, dv] -> [total_q, H, dv]; causal only, a window as (left, 0) or none."""
        if not causal or window_size[1] not in (0, -1):
            raise ValueError("native prefill attention is causal only")
        if q.stride(-1) != 1:
            raise ValueError("native prefill attention needs each query head's dimensions contiguous")
        k, v = k.contiguous(), v.contiguous()
        cu_q = cu_seqlens_q.to(torch.int32).contiguous()
        cu_k = cu_seqlens_k.to(torch.int32).contiguous()
        total_q, heads, head_dim = q.shape
        kv_heads, value_dim = k.shape[1], v.shape[2]
        if (heads % kv_heads or k.shape[2] != head_dim or v.shape[:2] != k.shape[:2]
                or cu_q.shape != cu_k.shape or head_dim % VECTOR_WIDTH or value_dim % VECTOR_WIDTH):
            raise ValueError("inconsistent shapes for native prefill attention")
        out = q.new_empty((total_q, heads, value_dim))
        left = window_size[0]
        scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
        failed = self._function(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), out.data_ptr(), cu_q.data_ptr(),
            cu_k.data_ptr(), cu_q.shape[0] - 1, heads, kv_heads, head_dim, value_dim, left + 1 if left >= 0 else 0,
            scale, torch.get_num_threads())
        if failed:
            raise MemoryError("native prefill attention could not allocate its scratch memory")
        return out

    def paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_slots: torch.Tensor,
              cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, softmax_scale: float | None = None,
              window: int | None = None) -> torch.Tensor:
        """The same attention with each chunk's keys read where the paged pool holds them:
        k_cache [slots, KVH, d] and v_cache [slots, KVH, dv] (contiguous, q's dtype), key_slots
        [total_k] the slot of each packed key (cu_seqlens_k's rows); causal, `window` keys at
        most (None: all) -> [total_q, H, dv]."""
        if q.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("native prefill attention needs contiguous caches and query heads")
        slots = key_slots.to(torch.int64).contiguous()
        cu_q = cu_seqlens_q.to(torch.int32).contiguous()
        cu_k = cu_seqlens_k.to(torch.int32).contiguous()
        total_q, heads, head_dim = q.shape
        kv_heads, value_dim = k_cache.shape[1], v_cache.shape[2]
        if (heads % kv_heads or k_cache.shape[2] != head_dim or v_cache.shape[:2] != k_cache.shape[:2]
                or cu_q.shape != cu_k.shape or head_dim % VECTOR_WIDTH or value_dim % VECTOR_WIDTH
                or slots.shape[0] != int(cu_k[-1]) or not (q.dtype == k_cache.dtype == v_cache.dtype)):
            raise ValueError("inconsistent shapes for native prefill attention")
        out = q.new_empty((total_q, heads, value_dim))
        scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
        failed = self._paged(
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
            out.data_ptr(), cu_q.data_ptr(), cu_k.data_ptr(), cu_q.shape[0] - 1, heads, kv_heads, head_dim,
            value_dim, window or 0, scale, torch.get_num_threads())
        if failed:
            raise MemoryError("native prefill attention could not allocate its scratch memory")
        return out


def load_native_prefill(backend: str, dtype: torch.dtype, cache_dir: Path | None = None) -> VarlenKernel | None:
    """The kernel for ATTENTION_BACKEND `backend` (`auto` or `native`) on CPU, or None for the
    SDPA path. Raises ValueError when `native` is required but cannot run here."""
    if dtype != torch.float32:
        if backend == "native":
            raise ValueError(f"ATTENTION_BACKEND=native needs float32 on CPU, not {dtype}")
        return None
    kernel, problem = _load_checked(cache_dir or default_cache_dir())
    if kernel is not None:
        return VarlenKernel("native", kernel, MAX_HEAD_DIM, VECTOR_WIDTH, paged=kernel.paged)
    if backend == "native":
        raise ValueError(f"ATTENTION_BACKEND=native cannot be used: {problem}")
    log.warning("native prefill attention unavailable; prefill chunks use SDPA", extra={"reason": problem})
    return None


@functools.lru_cache(maxsize=None)
def _load_checked(cache_dir: Path) -> tuple[NativePrefillAttention | None, str | None]:
    """(kernel, None), or (None, why not); once per process and cache dir."""
    try:
        kernel = NativePrefillAttention(load_library("prefill_attention", cache_dir))
    except NativeBuildError as error:
        return None, str(error)
    problem = check(kernel)
    return (kernel, None) if problem is None else (None, problem)


# (query heads, KV heads, head dim, window, (queries, keys) per chunk): fresh chunks and ones that
# continue their sequence, row counts off the kernel's tiles, keys off its blocks, a window
# shorter than a chunk, grouped and ungrouped heads.
CHECK_CASES = (
    (4, 1, 32, None, ((5, 5), (37, 37), (3, 70), (20, 300))),
    (8, 2, 16, 7, ((1, 1), (29, 29), (13, 40))),
    (3, 3, 48, None, ((9, 9), (2, 130))),
    (2, 1, 64, 100, ((150, 150), (64, 264))),
)


def check(kernel: NativePrefillAttention) -> str | None:
    """Runs the kernel on random chunks (CHECK_CASES) against the float64 reference; None when it agrees."""
    generator = torch.Generator().manual_seed(0)
    for heads, kv_heads, head_dim, window, lengths in CHECK_CASES:
        lens_q, lens_k = zip(*lengths)
        cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
        # The queries as the engine hands them over: a [1, H, T, d] tensor's transpose.
        q = (torch.randn(heads, sum(lens_q), head_dim, generator=generator) * 2).transpose(0, 1)
        k = torch.randn(sum(lens_k), kv_heads, head_dim, generator=generator)
        v = torch.randn(sum(lens_k), kv_heads, head_dim, generator=generator)
        scale = head_dim ** -0.5
        window_size = (window - 1, 0) if window else (-1, -1)
        out = kernel(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), softmax_scale=scale, causal=True,
                     window_size=window_size)
        expected = reference_varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, max(lens_q),
                                              max(lens_k), softmax_scale=scale, causal=True,
                                              window_size=window_size)
        error = float((out.double() - expected).abs().max())
        if not error <= CHECK_TOLERANCE * max(1.0, float(expected.abs().max())):
            return f"start-up check failed (max error {error:.3g})"
        # The same keys scattered over a larger pool, read through their slots: the same bits.
        slots = torch.randperm(2 * k.shape[0], generator=generator)[:k.shape[0]]
        k_cache = torch.randn(2 * k.shape[0], kv_heads, head_dim, generator=generator)
        v_cache = torch.randn(2 * k.shape[0], kv_heads, head_dim, generator=generator)
        k_cache[slots], v_cache[slots] = k, v
        paged = kernel.paged(q, k_cache, v_cache, slots, cu_q, cu_k, softmax_scale=scale, window=window)
        if not torch.equal(paged, out):
            return "start-up check failed (the paged entry differs from the contiguous one)"
    return None
