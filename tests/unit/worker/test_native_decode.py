"""The native paged decode attention kernel: against a float64 reference over the block
tables (grouped heads, sliding windows, split contexts, scattered blocks), its build
cache, and the choice between it and SDPA."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from services.worker.engine.cpu.kernels import native_build

from services.worker.engine.cpu.kernels import native_decode
from services.worker.engine.cpu.kernels.native_build import build
from services.worker.engine.cpu.kernels.native_decode import (
    MIN_SPLIT_CONTEXT, NativeDecodeAttention, load_decode_kernel, reference_decode_attention,
)

BLOCK_SIZE = 16
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> NativeDecodeAttention:
    loaded = load_decode_kernel("native", CPU, torch.float32, BLOCK_SIZE, tmp_path_factory.mktemp("kernels"))
    assert loaded is not None
    return loaded


def scattered_case(seed: int, lengths: list[int], heads: int, kv_heads: int, head_dim: int,
                   value_dim: int | None = None) -> dict:
    generator = torch.Generator().manual_seed(seed)
    per_seq = -(-max(lengths) // BLOCK_SIZE)
    num_blocks = len(lengths) * per_seq + 5
    tables = torch.randperm(num_blocks, generator=generator)[:len(lengths) * per_seq].view(len(lengths), per_seq)
    value_dim = value_dim or head_dim
    return dict(
        query=torch.randn(len(lengths), heads, head_dim, generator=generator) * 3,
        k_cache=torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim, generator=generator),
        v_cache=torch.randn(num_blocks * BLOCK_SIZE, kv_heads, value_dim, generator=generator),
        block_tables=tables.contiguous(), ctx_lens=torch.tensor(lengths, dtype=torch.int64))


def run(kernel: NativeDecodeAttention, case: dict, window: int | None, threads: int | None = None) -> torch.Tensor:
    query, v_cache = case["query"], case["v_cache"]
    out = torch.full((query.shape[0], query.shape[1], v_cache.shape[2]), float("nan"))
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        kernel(query, case["k_cache"], v_cache, case["block_tables"], case["ctx_lens"], BLOCK_SIZE,
               int(case["ctx_lens"].max()), window, query.shape[-1] ** -0.5, out)
    finally:
        torch.set_num_threads(before)
    return out


def reference(case: dict, window: int | None) -> torch.Tensor:
    return reference_decode_attention(case["query"], case["k_cache"], case["v_cache"], case["block_tables"],
                                      case["ctx_lens"], BLOCK_SIZE, window, case["query"].shape[-1] ** -0.5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (8, 2), (6, 1), (3, 3), (5, 1), (1, 1)])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_matches_the_reference(kernel: NativeDecodeAttention, heads: int, kv_heads: int,
                               window: int | None) -> None:
    case = scattered_case(heads * 10 + kv_heads, [1, 7, BLOCK_SIZE, BLOCK_SIZE + 1, 100], heads, kv_heads, 32)
    torch.testing.assert_close(run(kernel, case, window).double(), reference(case, window), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_contexts_split_across_threads_agree(kernel: NativeDecodeAttention, threads: int) -> None:
    # One sequence, fewer (sequence, KV head) pairs than threads: the context is split.
    case = scattered_case(7, [MIN_SPLIT_CONTEXT * 2 + 9], 4, 1, 64)
    torch.testing.assert_close(run(kernel, case, None, threads).double(), reference(case, None),
                               atol=2e-6, rtol=1e-5)
    windowed = run(kernel, case, MIN_SPLIT_CONTEXT + 3, threads).double()
    torch.testing.assert_close(windowed, reference(case, MIN_SPLIT_CONTEXT + 3), atol=2e-6, rtol=1e-5)


def test_value_dimension_may_differ_from_the_key_dimension(kernel: NativeDecodeAttention) -> None:
    case = scattered_case(3, [9, 33], 4, 2, 16, value_dim=40)
    torch.testing.assert_close(run(kernel, case, None).double(), reference(case, None), atol=2e-6, rtol=1e-5)


def test_matches_sdpa_on_the_default_models_shapes(kernel: NativeDecodeAttention) -> None:
    # Gemma 3 270M: 4 query heads on one KV head of 256; a context of a few hundred tokens.
    case = scattered_case(11, [300, 257, 64, 1, 450, 320, 200, 129], 4, 1, 256)
    got = run(kernel, case, 512)
    for seq, ctx in enumerate(case["ctx_lens"].tolist()):
        positions = torch.arange(ctx)
        slots = case["block_tables"][seq, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        k = case["k_cache"][slots].permute(1, 0, 2)[:, None]           # [1, 1, n, d]
        v = case["v_cache"][slots].permute(1, 0, 2)[:, None]
        q = case["query"][seq].view(1, 4, 1, 256).transpose(1, 2)     # heads sharing the KV head as rows
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v).reshape(4, 256)
        torch.testing.assert_close(got[seq], expected, atol=1e-5, rtol=1e-5)


def test_rejects_what_it_cannot_compute(kernel: NativeDecodeAttention) -> None:
    case = scattered_case(1, [5, 6], 4, 1, 16)
    out = torch.empty(2, 4, 16)
    strided_query = torch.randn(4, 2, 16).transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        kernel(strided_query, case["k_cache"], case["v_cache"], case["block_tables"],
               case["ctx_lens"], BLOCK_SIZE, 5, None, 0.25, out)
    with pytest.raises(ValueError, match="int64"):
        kernel(case["query"], case["k_cache"], case["v_cache"], case["block_tables"].int(),
               case["ctx_lens"], BLOCK_SIZE, 5, None, 0.25, out)
    odd = torch.zeros(8, 1, 12)
    assert not kernel.supports(case["query"], odd, odd)
    assert not kernel.supports(case["query"].double(), case["k_cache"], case["v_cache"])
    assert kernel.supports(case["query"], case["k_cache"], case["v_cache"])


def test_the_build_is_cached_per_source_and_machine(tmp_path: Path) -> None:
    first = build("paged_decode", tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build("paged_decode", tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]   # no temporary files left


def test_the_backend_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             caplog: pytest.LogCaptureFixture) -> None:
    assert load_decode_kernel("sdpa", CPU, torch.float32, BLOCK_SIZE, tmp_path) is None
    assert load_decode_kernel("auto", CPU, torch.bfloat16, BLOCK_SIZE, tmp_path) is None
    with pytest.raises(ValueError, match="unknown decode attention"):
        load_decode_kernel("fast", CPU, torch.float32, BLOCK_SIZE, tmp_path)
    with pytest.raises(ValueError, match="CPU float32"):
        load_decode_kernel("native", CPU, torch.bfloat16, BLOCK_SIZE, tmp_path)

    # Without a C compiler: `auto` falls back to SDPA and says why; `native` refuses.
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    missing = tmp_path / "elsewhere"
    with caplog.at_level(logging.WARNING, logger=native_decode.__name__):
        assert load_decode_kernel("auto", CPU, torch.float32, BLOCK_SIZE, missing) is None
    assert "no C compiler" in caplog.records[-1].reason
    with pytest.raises(ValueError, match="no C compiler"):
        load_decode_kernel("native", CPU, torch.float32, BLOCK_SIZE, missing)


def test_a_kernel_that_fails_its_check_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_decode, "CHECK_TOLERANCE", -1.0)   # nothing can pass
    cache_dir = tmp_path / "strict"
    assert load_decode_kernel("auto", CPU, torch.float32, BLOCK_SIZE, cache_dir) is None
    with pytest.raises(ValueError, match="start-up check failed"):
        load_decode_kernel("native", CPU, torch.float32, BLOCK_SIZE, cache_dir)
    assert os.listdir(cache_dir)   # it did build


def test_a_lone_sequence_splits_its_context_across_the_threads_from_a_short_context() -> None:
    """One stream's decode (W1: ~300 tokens) attends on every thread; short contexts, enough
    pairs for the threads, or one thread keep one range per pair."""
    assert native_decode.context_splits(1, 1, 2, 300) == 2
    assert native_decode.context_splits(1, 1, 2, MIN_SPLIT_CONTEXT) == 2
    assert native_decode.context_splits(1, 1, 2, MIN_SPLIT_CONTEXT - 1) == 1
    assert native_decode.context_splits(1, 1, 4, 300) == 4
    assert native_decode.context_splits(2, 1, 2, 300) == 1
    assert native_decode.context_splits(1, 1, 1, 300) == 1
    assert MIN_SPLIT_CONTEXT <= 128
