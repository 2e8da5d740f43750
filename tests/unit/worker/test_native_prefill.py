"""The native prefill attention kernel: against the float64 varlen reference (grouped heads,
sliding windows, chunks that continue their sequence, sizes off the kernel's tiles and key
blocks), across thread counts, what it refuses, and the ATTENTION_BACKEND choice on CPU."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from services.worker.engine.cpu.kernels import native_build

from services.worker.engine.cpu.kernels import native_prefill
from services.worker.engine.cpu.kernels.native_prefill import NativePrefillAttention, load_native_prefill
from services.worker.engine.step.varlen import reference_varlen_attention
from services.worker.wiring import load_prefill_kernel

CPU = torch.device("cpu")
TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> NativePrefillAttention:
    loaded = load_native_prefill("native", torch.float32, tmp_path_factory.mktemp("kernels"))
    assert loaded is not None and loaded.name == "native"
    return loaded.function


def packed_case(seed: int, lengths: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
                value_dim: int | None = None, transposed: bool = True) -> dict:
    """Chunks of (queries, keys); queries as the engine hands them over (a [H, T, d] tensor's
    transpose) or contiguous [T, H, d]."""
    generator = torch.Generator().manual_seed(seed)
    lens_q, lens_k = zip(*lengths)
    total_q, total_k = sum(lens_q), sum(lens_k)
    if transposed:
        q = torch.randn(heads, total_q, head_dim, generator=generator).transpose(0, 1) * 3
    else:
        q = torch.randn(total_q, heads, head_dim, generator=generator) * 3
    return dict(
        q=q, k=torch.randn(total_k, kv_heads, head_dim, generator=generator),
        v=torch.randn(total_k, kv_heads, value_dim or head_dim, generator=generator),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32),
        max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))


def window_size(window: int | None) -> tuple[int, int]:
    return (window - 1, 0) if window else (-1, -1)


def run(kernel: NativePrefillAttention, case: dict, window: int | None, threads: int | None = None) -> torch.Tensor:
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return kernel(*case.values(), softmax_scale=case["q"].shape[-1] ** -0.5, causal=True,
                      window_size=window_size(window))
    finally:
        torch.set_num_threads(before)


def reference(case: dict, window: int | None) -> torch.Tensor:
    double = {name: value.double() if torch.is_tensor(value) and value.is_floating_point() else value
              for name, value in case.items()}
    return reference_varlen_attention(*double.values(), softmax_scale=case["q"].shape[-1] ** -0.5, causal=True,
                                      window_size=window_size(window))


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == expected.shape
    error = float((got.double() - expected).abs().max())
    assert error <= TOLERANCE * max(1.0, float(expected.abs().max())), error


# Fresh chunks, chunks continuing their sequence, one-token chunks, rows off the kernel's tiles
# (6 or 4 rows a pass, 24 a work item) and keys off its blocks (64/256 keys, or 24/96 on AVX2).
LAYOUTS = {
    "fresh": [(7, 7), (30, 30), (1, 1)],
    "continuing": [(5, 40), (1, 97), (33, 290)],
    "mixed": [(25, 25), (3, 259), (64, 64), (17, 300)],
}


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (8, 2), (3, 3), (6, 1), (5, 1), (1, 1)])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_matches_the_reference(kernel: NativePrefillAttention, heads: int, kv_heads: int, window: int | None,
                               layout: str) -> None:
    case = packed_case(heads * 100 + kv_heads, LAYOUTS[layout], heads, kv_heads, 32)
    assert_matches(run(kernel, case, window), reference(case, window))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(kernel: NativePrefillAttention, threads: int) -> None:
    case = packed_case(7, [(40, 40), (9, 600), (130, 130)], 4, 1, 64)
    assert_matches(run(kernel, case, None, threads), reference(case, None))


def test_long_contexts_span_several_key_blocks(kernel: NativePrefillAttention) -> None:
    case = packed_case(11, [(300, 1100), (700, 700)], 4, 1, 16)
    for window in (None, 512):
        assert_matches(run(kernel, case, window), reference(case, window))


def test_contiguous_queries_and_a_value_dimension_of_its_own(kernel: NativePrefillAttention) -> None:
    case = packed_case(3, LAYOUTS["mixed"], 4, 2, 48, value_dim=80, transposed=False)
    assert_matches(run(kernel, case, None), reference(case, None))


def test_matches_sdpa_on_the_default_models_shapes(kernel: NativePrefillAttention) -> None:
    """Gemma 3 270M: 4 query heads of 256 over one K/V head, a step of W1-like chunks."""
    case = packed_case(5, [(277, 277), (277, 277), (120, 277)], 4, 1, 256)
    got = run(kernel, case, None)
    bounds_q, bounds_k = case["cu_seqlens_q"].tolist(), case["cu_seqlens_k"].tolist()
    for index in range(len(bounds_q) - 1):
        q = case["q"][bounds_q[index]:bounds_q[index + 1]].transpose(0, 1).unsqueeze(0)
        k = case["k"][bounds_k[index]:bounds_k[index + 1]].transpose(0, 1).unsqueeze(0)
        v = case["v"][bounds_k[index]:bounds_k[index + 1]].transpose(0, 1).unsqueeze(0)
        queries, keys = q.shape[2], k.shape[2]
        mask = torch.arange(keys)[None, :] <= torch.arange(keys - queries, keys)[:, None]
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1 / 16,
                                                                    enable_gqa=True)
        torch.testing.assert_close(got[bounds_q[index]:bounds_q[index + 1]], expected[0].transpose(0, 1),
                                   atol=1e-5, rtol=1e-4)


def test_a_query_that_sees_no_key_gets_zeros(kernel: NativePrefillAttention) -> None:
    case = packed_case(2, [(6, 3)], 2, 1, 16)
    got = run(kernel, case, None)
    assert_matches(got, reference(case, None))
    assert not got[:3].any() and got[3:].abs().sum() > 0


def test_rejects_what_it_cannot_compute(kernel: NativePrefillAttention) -> None:
    case = packed_case(1, [(4, 4)], 4, 1, 16)
    with pytest.raises(ValueError, match="causal only"):
        kernel(*case.values(), causal=False)
    with pytest.raises(ValueError, match="causal only"):
        kernel(*case.values(), causal=True, window_size=(3, 2))
    odd = packed_case(1, [(4, 4)], 4, 1, 12)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        kernel(*odd.values(), causal=True)
    uneven = packed_case(1, [(4, 4)], 3, 2, 16)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        kernel(*uneven.values(), causal=True)
    strided = dict(case, q=torch.randn(4, 4, 32)[:, :, ::2])
    with pytest.raises(ValueError, match="contiguous"):
        kernel(*strided.values(), causal=True)


def test_the_backend_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             caplog: pytest.LogCaptureFixture) -> None:
    assert load_prefill_kernel("sdpa", CPU, torch.float32, tmp_path) is None
    assert load_prefill_kernel("auto", CPU, torch.bfloat16, tmp_path) is None
    with pytest.raises(ValueError, match="unknown attention backend"):
        load_prefill_kernel("xformers", CPU, torch.float32, tmp_path)
    with pytest.raises(ValueError, match="needs float32"):
        load_prefill_kernel("native", CPU, torch.bfloat16, tmp_path)
    with pytest.raises(ValueError, match="needs CPU"):
        load_prefill_kernel("native", torch.device("cuda"), torch.float32, tmp_path)
    with pytest.raises(ValueError, match="flash_attn.*needs CUDA"):
        load_prefill_kernel("flash_attn", CPU, torch.float32, tmp_path)
    loaded = load_prefill_kernel("auto", CPU, torch.float32, tmp_path)
    assert loaded is not None and loaded.supports(256, 256) and not loaded.supports(24, 24)

    # Without a C compiler: `auto` falls back to SDPA and says why; `native` refuses.
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    missing = tmp_path / "elsewhere"
    with caplog.at_level(logging.WARNING, logger=native_prefill.__name__):
        assert load_prefill_kernel("auto", CPU, torch.float32, missing) is None
    assert "no C compiler" in caplog.records[-1].reason
    with pytest.raises(ValueError, match="no C compiler"):
        load_prefill_kernel("native", CPU, torch.float32, missing)


def test_a_kernel_that_fails_its_check_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_prefill, "CHECK_TOLERANCE", -1.0)   # nothing can pass
    cache_dir = tmp_path / "strict"
    assert load_native_prefill("auto", torch.float32, cache_dir) is None
    with pytest.raises(ValueError, match="start-up check failed"):
        load_native_prefill("native", torch.float32, cache_dir)
    assert any(cache_dir.iterdir())   # it did build


def scattered(case: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The case's keys and values scattered over a pool twice their size: (k_cache, v_cache, slots)."""
    generator = torch.Generator().manual_seed(seed)
    k, v = case["k"], case["v"]
    slots = torch.randperm(2 * k.shape[0], generator=generator)[:k.shape[0]]
    k_cache = torch.randn(2 * k.shape[0], *k.shape[1:], generator=generator)
    v_cache = torch.randn(2 * v.shape[0], *v.shape[1:], generator=generator)
    k_cache[slots], v_cache[slots] = k, v
    return k_cache, v_cache, slots


def run_paged(kernel: NativePrefillAttention, case: dict, seed: int, window: int | None,
              threads: int) -> torch.Tensor:
    """The paged entry on `case`'s keys scattered over a larger pool (seed: the scatter)."""
    k_cache, v_cache, slots = scattered(case, seed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return kernel.paged(case["q"], k_cache, v_cache, slots, case["cu_seqlens_q"], case["cu_seqlens_k"],
                            softmax_scale=case["q"].shape[-1] ** -0.5, window=window)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_paged_entry_reads_keys_through_their_slots(kernel: NativePrefillAttention, window: int | None,
                                                        threads: int) -> None:
    """Keys read where a pool holds them give the bits the contiguous entry gives on the
    gathered copy: fresh chunks, continuing ones, several key blocks, grouped heads."""
    case = packed_case(11, [(5, 5), (37, 37), (3, 70), (20, 300), (1, 129)], 4, 1, 32)
    expected = run(kernel, case, window, threads)
    assert torch.equal(run_paged(kernel, case, 12, window, threads), expected)


@pytest.mark.parametrize("window", [None, 512])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_cached_prompts_new_tokens_over_its_context(kernel: NativePrefillAttention, window: int | None,
                                                      threads: int) -> None:
    """A prompt whose prefix the pool holds: a few new queries over a long context read through
    their slots, on the default model's shapes (4 query heads over one K/V head of 256), with
    query counts that split into work items of uneven tiles (10 at up to 6 a tile: 5 and 5; 13:
    5, 4 and 4) and key counts off the transposed tiles' 16 and 64 keys."""
    case = packed_case(15, [(10, 1496), (1, 1496), (13, 523), (6, 701)], 4, 1, 256)
    got = run_paged(kernel, case, 16, window, threads)
    assert_matches(got, reference(case, window))
    assert torch.equal(got, run(kernel, case, window, threads))


def test_the_paged_entry_refuses_what_it_cannot_read(kernel: NativePrefillAttention) -> None:
    case = packed_case(13, [(4, 9)], 2, 1, 16)
    k_cache, v_cache, slots = scattered(case, 14)
    arguments = (case["cu_seqlens_q"], case["cu_seqlens_k"])
    with pytest.raises(ValueError, match="inconsistent"):
        kernel.paged(case["q"], k_cache, v_cache, slots[:-1], *arguments)             # a key without a slot
    with pytest.raises(ValueError, match="inconsistent"):
        kernel.paged(case["q"], k_cache.double(), v_cache.double(), slots, *arguments)  # another dtype
    with pytest.raises(ValueError, match="contiguous"):
        kernel.paged(case["q"], torch.cat([k_cache, k_cache], dim=2)[:, :, :16], v_cache, slots, *arguments)
