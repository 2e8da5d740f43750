"""Fused varlen prefill attention: the reference kernel against the documented
flash-attn contract, and the engine driven through it (on CPU) against transformers.
The flash-attn test at the end runs only where CUDA and the package are present."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu.kernels.native_prefill import load_native_prefill
from services.worker.engine.cuda import varlen_attention
from services.worker.engine.cuda.varlen_attention import load_varlen_kernel
from services.worker.engine.step.varlen import VarlenKernel, reference_varlen_attention
from services.worker.wiring import build_engine, device_accelerators
from tests.fixtures.tiny_model import build_model
from tests.unit.worker.engine_helpers import (
    CONFIGS,
    Driver,
    RecordingSampler,
    assert_greedy_matches,
    assert_rows_match,
    generate,
    prompt_of,
    reference_model,
)

LOGITS_ATOL = 1e-4


class CountingKernel:
    """Checks and counts the calls, then runs `inner` (default: the reference kernel)."""

    def __init__(self, inner=reference_varlen_attention) -> None:
        self.calls: list[int] = []     # sequences per call
        self.inner = inner

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert int(cu_seqlens_q[-1]) == q.shape[0] and int(cu_seqlens_k[-1]) == k.shape[0] == v.shape[0]
        lens_q, lens_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
        assert int(lens_q.max()) == max_seqlen_q and int(lens_k.max()) == max_seqlen_k
        # Every chunk's queries are the last rows of its keys.
        assert bool((lens_k >= lens_q).all())
        self.calls.append(len(lens_q))
        return self.inner(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


class CountingPaged:
    """Checks and counts the calls of a kernel reading the pool through slots, then runs it."""

    def __init__(self, inner) -> None:
        self.calls = 0
        self.inner = inner

    def __call__(self, q, k_cache, v_cache, key_slots, cu_seqlens_q, cu_seqlens_k, **kwargs):
        assert int(cu_seqlens_k[-1]) == key_slots.shape[0] and int(cu_seqlens_q[-1]) == q.shape[0]
        assert bool((cu_seqlens_k.diff() >= cu_seqlens_q.diff()).all())
        assert int(key_slots.max()) < k_cache.shape[0] == v_cache.shape[0]
        self.calls += 1
        return self.inner(q, k_cache, v_cache, key_slots, cu_seqlens_q, cu_seqlens_k, **kwargs)


def varlen_engine(kind: str, kernel: CountingKernel, max_head_dim: int = 256, paged=None, **config) -> Engine:
    """The worker's engine with `kernel` as its prefill chunks' fused kernel (`paged`: its
    entry reading the pool through slots)."""
    accelerators = dataclasses.replace(
        device_accelerators(),
        prefill_kernel=lambda backend, device, dtype, cache_dir: VarlenKernel("reference", kernel, max_head_dim,
                                                                              paged=paged))
    model = build_model(copy.deepcopy(CONFIGS[kind]()))
    return Engine(EngineConfig(model_dir="", num_blocks=128, block_size=4, model_key=kind, **config), model=model,
                  accelerators=accelerators)


def native_kernel():
    loaded = load_native_prefill("native", torch.float32)
    assert loaded is not None
    return loaded.function


# ---- the reference kernel -----------------------------------------------------------------------


def _attention_weights_visible(seqlen_q: int, seqlen_k: int, window: tuple[int, int]) -> torch.Tensor:
    """Which keys each query attends to, read off the reference kernel with V = identity."""
    torch.manual_seed(0)
    q = torch.randn(seqlen_q, 1, 4)
    k = torch.randn(seqlen_k, 1, 4)
    v = torch.eye(seqlen_k)[:, None, :]
    out = reference_varlen_attention(q, k, v, torch.tensor([0, seqlen_q], dtype=torch.int32),
                                     torch.tensor([0, seqlen_k], dtype=torch.int32), seqlen_q, seqlen_k,
                                     causal=True, window_size=window)
    return (out[:, 0] > 0).int()


def test_reference_kernel_aligns_the_causal_mask_to_the_bottom_right() -> None:
    # The examples of flash_attn_varlen_func's docstring.
    assert _attention_weights_visible(2, 5, (-1, -1)).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert _attention_weights_visible(5, 2, (-1, -1)).tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]


def test_reference_kernel_window_keeps_left_plus_one_keys() -> None:
    visible = _attention_weights_visible(3, 6, (1, 0))
    assert visible.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]


def test_reference_kernel_matches_sdpa_per_sequence_with_gqa() -> None:
    torch.manual_seed(1)
    lens_q, lens_k = [3, 1, 5], [7, 4, 5]
    q = torch.randn(sum(lens_q), 4, 8)
    k = torch.randn(sum(lens_k), 2, 8)
    v = torch.randn(sum(lens_k), 2, 8)
    cu_q = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 11, 16], dtype=torch.int32)
    out = reference_varlen_attention(q, k, v, cu_q, cu_k, 5, 7, softmax_scale=0.3, causal=True)
    for index in range(3):
        qs, ks = slice(int(cu_q[index]), int(cu_q[index + 1])), slice(int(cu_k[index]), int(cu_k[index + 1]))
        offset = lens_k[index] - lens_q[index]
        mask = torch.arange(lens_k[index])[None, :] <= torch.arange(lens_q[index])[:, None] + offset
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[qs].transpose(0, 1), k[ks].repeat_interleave(2, dim=1).transpose(0, 1),
            v[ks].repeat_interleave(2, dim=1).transpose(0, 1), attn_mask=mask, scale=0.3)
        torch.testing.assert_close(out[qs], expected.transpose(0, 1))


# ---- loading ------------------------------------------------------------------------------------


def test_loading_picks_flash_attn_only_on_cuda_in_half_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = object()
    monkeypatch.setattr(varlen_attention, "import_flash_attn", lambda: fake)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    kernel = load_varlen_kernel("auto", cuda, torch.bfloat16)
    assert kernel is not None and kernel.function is fake and kernel.name == "flash_attn"
    assert not kernel.supports(512, 512) and kernel.supports(256, 256)
    assert load_varlen_kernel("auto", cuda, torch.float32) is None
    assert load_varlen_kernel("auto", cpu, torch.bfloat16) is None
    assert load_varlen_kernel("sdpa", cuda, torch.bfloat16) is None
    with pytest.raises(ValueError, match="ATTENTION_BACKEND=flash_attn.*needs CUDA"):
        load_varlen_kernel("flash_attn", cpu, torch.float32)
    with pytest.raises(ValueError, match="unknown attention backend"):
        load_varlen_kernel("xformers", cuda, torch.bfloat16)
    monkeypatch.setattr(varlen_attention, "import_flash_attn", lambda: None)
    assert load_varlen_kernel("auto", cuda, torch.bfloat16) is None
    with pytest.raises(ValueError, match="does not import"):
        load_varlen_kernel("flash_attn", cuda, torch.bfloat16)


def test_cpu_engine_uses_the_native_kernel_by_default_and_sdpa_when_asked() -> None:
    for backend, expected in (("auto", "native"), ("native", "native"), ("sdpa", "sdpa")):
        engine = build_engine(EngineConfig(model_dir="", num_blocks=8, block_size=4, attention_backend=backend),
                              model=build_model(copy.deepcopy(CONFIGS["llama"]())))
        assert engine.attention_kernel == expected


# ---- the engine through the varlen path ---------------------------------------------------------


@pytest.mark.parametrize("inner", ["reference", "native"])
@pytest.mark.parametrize("kind", ["gemma3", "gemma4", "llama", "qwen2_sliding"])
def test_chunked_prefill_through_one_varlen_call_per_layer_matches_transformers(kind: str, inner: str) -> None:
    kernel = CountingKernel(native_kernel() if inner == "native" else reference_varlen_attention)
    engine = varlen_engine(kind, kernel, prompt_logits_cache_size=0)
    assert engine.attention_kernel == "reference"
    assert_chunked_prefill_matches_transformers(kind, engine)
    # One call per layer per step with prefill chunks, carrying all of them.
    assert max(kernel.calls) >= 3


def assert_chunked_prefill_matches_transformers(kind: str, engine: Engine) -> None:
    """Chunks continuing their sequences, several per step, longer than the sliding window (8):
    the greedy tokens and every sampled row's logits of transformers' model."""
    recorder = RecordingSampler(engine.sampler)
    engine.sampler = recorder
    prompts = {"short": prompt_of(3, 1), "mid": prompt_of(9, 2), "long": prompt_of(30, 3), "odd": prompt_of(17, 4)}
    got = Driver(engine).run(prompts, 8, {"short": 64, "mid": 4, "long": 11, "odd": 5})
    reference = reference_model(kind)
    assert_greedy_matches(reference, prompts, got, 8)
    assert_rows_match(reference, recorder, LOGITS_ATOL)


@pytest.mark.parametrize("kind", ["gemma3", "llama", "qwen2_sliding"])
def test_chunks_reading_the_pool_through_slots_match_transformers(kind: str) -> None:
    """The native kernel's paged entry: every chunk's keys read where the pool holds them (no
    gathered copy), fresh chunks and ones that continue their sequence, past the window."""
    native = load_native_prefill("native", torch.float32)
    assert native is not None and native.paged is not None
    kernel, paged = CountingKernel(native.function), CountingPaged(native.paged)
    engine = varlen_engine(kind, kernel, paged=paged, prompt_logits_cache_size=0)
    assert_chunked_prefill_matches_transformers(kind, engine)
    assert paged.calls and not kernel.calls


def test_a_shared_prefix_read_through_slots() -> None:
    native = load_native_prefill("native", torch.float32)
    assert native is not None
    paged = CountingPaged(native.paged)
    engine = varlen_engine("gemma3", CountingKernel(native.function), paged=paged, prompt_logits_cache_size=0)
    driver = Driver(engine)
    base = prompt_of(21, 8)
    driver.run({"first": base}, 4)
    forked = base[:16] + prompt_of(6, 9)[1:]
    got = driver.run({"forked": forked}, 4)
    assert driver.cached["forked"] == 16 and paged.calls
    assert got["forked"] == generate(reference_model("gemma3"), forked, 4)


def test_shared_prefix_chunks_read_their_context_through_the_kernel() -> None:
    kernel = CountingKernel()
    engine = varlen_engine("gemma3", kernel, prompt_logits_cache_size=0)
    driver = Driver(engine)
    base = prompt_of(21, 8)
    driver.run({"first": base}, 4)
    forked = base[:16] + prompt_of(6, 9)[1:]
    got = driver.run({"forked": forked}, 4)
    assert driver.cached["forked"] == 16
    assert got["forked"] == generate(reference_model("gemma3"), forked, 4)


def test_layers_the_kernel_cannot_take_fall_back_to_sdpa() -> None:
    # Gemma 4 tiny: sliding layers have head_dim 16, global ones 32.
    kernel = CountingKernel()
    engine = varlen_engine("gemma4", kernel, max_head_dim=16)
    prompts = {"a": prompt_of(12, 1), "b": prompt_of(20, 2)}
    got = Driver(engine).run(prompts, 6, {"a": 5, "b": 7})
    assert_greedy_matches(reference_model("gemma4"), prompts, got, 6)
    assert kernel.calls


@pytest.mark.skipif(not torch.cuda.is_available() or varlen_attention.import_flash_attn() is None,
                    reason="needs CUDA and the flash-attn package")
def test_flash_attn_prefill_matches_sdpa_on_a_gpu() -> None:
    prompts = {"a": prompt_of(12, 1), "b": prompt_of(30, 2), "c": prompt_of(17, 3)}
    chunks = {"a": 5, "b": 11, "c": 64}
    outputs = {}
    for backend in ("flash_attn", "sdpa"):
        model = build_model(copy.deepcopy(CONFIGS["gemma3"]()))
        engine = build_engine(EngineConfig(model_dir="", device="cuda", dtype="bfloat16", num_blocks=128, block_size=4,
                                           attention_backend=backend, use_cuda_graphs=False), model=model)
        assert engine.attention_kernel == ("flash_attn" if backend == "flash_attn" else "sdpa")
        recorder = RecordingSampler(engine.sampler)
        engine.sampler = recorder
        Driver(engine).run(prompts, 4, chunks)
        outputs[backend] = torch.stack([row for row, _ in recorder.rows]).float()
    torch.testing.assert_close(outputs["flash_attn"], outputs["sdpa"], atol=0.1, rtol=0.02)
