"""Decode attention read straight from the paged K/V cache, on CPU in float32.

The SDPA path gathers every decoding sequence's context out of the block pool
into contiguous K/V tensors, layer by layer, then attends over the copy. On a
CPU that copy streams the context through memory twice more; at 8 sequences
of ~300 tokens on the default model it cost about as much as the attention
itself. `native/paged_decode.c` attends through the block tables instead,
reading each K and V row once for all the query heads that share it, and
splits long contexts across threads when there are fewer sequences than
threads.

It is compiled once per machine (`native_build.py`) and loaded with ctypes.
`DECODE_ATTENTION` picks it:
`auto` uses it when it builds and its start-up check against a float64
reference passes, `native` requires it, `sdpa` never uses it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from services.worker.engine.cpu.kernels.native_build import NativeBuildError, default_cache_dir, load_library

log = logging.getLogger(__name__)

BACKENDS = ("auto", "native", "sdpa")
# Contexts shorter than this are never split across threads (docs/engine/attention.md: at one
# sequence a split paid from ~50 tokens of context on the 2-core AMD EPYC Zen 4; 512 before).
MIN_SPLIT_CONTEXT = 64
# The kernel works on 8 floats at a time: head dimensions must be multiples of it.
VECTOR_WIDTH = 8
# A check mismatch beyond this relative error disables the kernel.
CHECK_TOLERANCE = 1e-4


class NativeDecodeAttention:
    """ctypes binding of fairserve_paged_decode_attention; see the module docstring."""

    name = "native"

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.fairserve_paged_decode_attention
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float] + [ctypes.c_int64] * 2
        self._function = function

    @property
    def attention_function(self) -> ctypes._CFuncPtr:
        """The C function itself, for native_layers.py to call from C."""
        return self._function

    def supports(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return (query.device.type == "cpu" and query.dtype == k_cache.dtype == v_cache.dtype == torch.float32
                and k_cache.shape[-1] % VECTOR_WIDTH == 0 and v_cache.shape[-1] % VECTOR_WIDTH == 0)

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, ctx_lens: torch.Tensor, block_size: int, longest_context: int,
                 window: int | None, scale: float, out: torch.Tensor) -> None:
        """query [D, H, d], caches [slots, KVH, d|dv], block_tables [D, W] and ctx_lens [D]
        (int64, context including the decoded token; `longest_context` is their maximum,
        known on the host) -> out [D, H, dv], written in place."""
        for tensor in (query, k_cache, v_cache, block_tables, ctx_lens, out):
            if not tensor.is_contiguous():
                raise ValueError("native decode attention needs contiguous tensors")
        if block_tables.dtype != torch.int64 or ctx_lens.dtype != torch.int64:
            raise ValueError("block tables and context lengths must be int64")
        seqs, heads, head_dim = query.shape
        kv_heads, value_dim = k_cache.shape[1], v_cache.shape[2]
        if (heads % kv_heads or out.shape != (seqs, heads, value_dim) or k_cache.shape[2] != head_dim
                or head_dim % VECTOR_WIDTH or value_dim % VECTOR_WIDTH):
            raise ValueError("inconsistent shapes for native decode attention")
        threads = torch.get_num_threads()
        attended = longest_context if window is None else min(longest_context, window)
        splits = context_splits(seqs, kv_heads, threads, attended)
        failed = self._function(
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            ctx_lens.data_ptr(), out.data_ptr(), seqs, heads, kv_heads, head_dim, value_dim,
            block_tables.shape[1], block_size, window or 0, scale, splits, threads)
        if failed:
            raise MemoryError("native decode attention could not allocate its scratch memory")


def load_decode_kernel(backend: str, device: torch.device, dtype: torch.dtype, block_size: int,
                       cache_dir: Path | None = None) -> NativeDecodeAttention | None:
    """The kernel `backend` asks for on this device and dtype, or None for the SDPA path.
    Raises ValueError when `native` is required but cannot run here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown decode attention {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "sdpa":
        return None
    if device.type != "cpu" or dtype != torch.float32:
        if backend == "native":
            raise ValueError(f"DECODE_ATTENTION=native needs CPU float32, not {device.type} {dtype}")
        return None
    kernel, problem = _load_checked(cache_dir or default_cache_dir(), block_size)
    if kernel is not None:
        return kernel
    if backend == "native":
        raise ValueError(f"DECODE_ATTENTION=native cannot be used: {problem}")
    log.warning("native decode attention unavailable; decodes gather K/V for SDPA", extra={"reason": problem})
    return None


@functools.lru_cache(maxsize=None)
def _load_checked(cache_dir: Path, block_size: int) -> tuple[NativeDecodeAttention | None, str | None]:
    """(kernel, None), or (None, why not); once per process for each cache dir and block size."""
    try:
        kernel = NativeDecodeAttention(load_library("paged_decode", cache_dir))
    except NativeBuildError as error:
        return None, str(error)
    problem = check(kernel, block_size)
    return (kernel, None) if problem is None else (None, problem)


def reference_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, ctx_lens: torch.Tensor, block_size: int,
                               window: int | None, scale: float) -> torch.Tensor:
    """The same contract in float64, one sequence at a time: [D, H, dv]."""
    seqs, heads, _ = query.shape
    group = heads // k_cache.shape[1]
    out = []
    for seq in range(seqs):
        ctx = int(ctx_lens[seq])
        positions = torch.arange(max(0, ctx - window) if window else 0, ctx)
        slots = block_tables[seq, positions // block_size] * block_size + positions % block_size
        keys = k_cache[slots].double().repeat_interleave(group, dim=1)       # [n, H, d]
        values = v_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[seq].double(), keys) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), values))
    return torch.stack(out)


def check(kernel: NativeDecodeAttention, block_size: int) -> str | None:
    """Runs the kernel on random inputs (grouped heads, a sliding window, split and unsplit
    contexts, scattered blocks) against the float64 reference; None when it agrees."""
    generator = torch.Generator().manual_seed(0)
    for seqs, heads, kv_heads, head_dim, window, lengths in (
            (3, 4, 1, 64, None, (1, block_size + 3, 5 * block_size)),
            (2, 8, 2, 40, 7, (3, 4 * block_size + 1)),
            (1, 6, 1, 24, None, (MIN_SPLIT_CONTEXT + 3 * block_size + 5,)),
            (2, 3, 3, 16, None, (2, 2 * block_size + 1))):
        blocks_per_seq = -(-max(lengths) // block_size)
        num_blocks = seqs * blocks_per_seq + 3
        order = torch.randperm(num_blocks, generator=generator)[:seqs * blocks_per_seq]
        tables = order.view(seqs, blocks_per_seq).contiguous()
        ctx = torch.tensor(lengths, dtype=torch.int64)
        k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
        v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
        query = torch.randn(seqs, heads, head_dim, generator=generator) * 2
        out = torch.empty(seqs, heads, head_dim)
        scale = head_dim ** -0.5
        kernel(query, k_cache, v_cache, tables, ctx, block_size, max(lengths), window, scale, out)
        expected = reference_decode_attention(query, k_cache, v_cache, tables, ctx, block_size, window, scale)
        error = float((out.double() - expected).abs().max())
        if not error <= CHECK_TOLERANCE * max(1.0, float(expected.abs().max())):
            return f"start-up check failed (max error {error:.3g})"
    return None


def context_splits(seqs: int, kv_heads: int, threads: int, attended: int) -> int:
    """How many ranges each (sequence, KV head)'s context is split into: enough for every
    thread to have work when there are fewer pairs than threads, for contexts long enough
    that the merge pays (MIN_SPLIT_CONTEXT); else 1."""
    pairs = seqs * kv_heads
    return -(-threads // pairs) if pairs < threads and attended >= MIN_SPLIT_CONTEXT else 1
