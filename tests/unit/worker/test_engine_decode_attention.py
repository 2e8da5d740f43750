"""The engine's decodes through the native paged kernel against transformers and
against the gathered SDPA path: same greedy tokens, logits within float32 noise, on
every model family (sliding windows, grouped heads, Gemma 4's KV sharing)."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.cpu.kernels.native_decode import NativeDecodeAttention
from tests.unit.worker.engine_helpers import (
    CONFIGS,
    Driver,
    assert_greedy_matches,
    assert_rows_match,
    prompt_of,
    recording_engine,
    reference_model,
)

LOGITS_ATOL = 1e-4


class CountingKernel:
    """Wraps the engine's native kernel and counts the decode rows it served."""

    def __init__(self, inner: NativeDecodeAttention) -> None:
        self.inner = inner
        self.rows = 0

    def supports(self, *tensors: torch.Tensor) -> bool:
        return self.inner.supports(*tensors)

    def __call__(self, query: torch.Tensor, *args, **kwargs) -> None:
        self.rows += query.shape[0]
        self.inner(query, *args, **kwargs)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_native_decodes_match_transformers_and_sdpa(kind: str) -> None:
    # Mixed lengths (some past the tiny models' sliding windows), decoded together.
    prompts = {"a": prompt_of(5, 1), "b": prompt_of(23, 2), "c": prompt_of(40, 3)}
    outputs = {}
    for backend in ("native", "sdpa"):
        engine, recorder = recording_engine(kind, decode_attention=backend)
        assert engine.decode_attention == backend
        if backend == "native":
            assert engine.forward.decode_kernel is not None
            engine.forward.decode_kernel = counting = CountingKernel(engine.forward.decode_kernel)
        outputs[backend] = Driver(engine).run(prompts, max_new_tokens=12)
        assert_rows_match(reference_model(kind), recorder, LOGITS_ATOL)
    assert counting.rows > 0
    assert outputs["native"] == outputs["sdpa"]
    assert_greedy_matches(reference_model(kind), prompts, outputs["native"], 12)


def test_auto_picks_native_on_cpu_float32() -> None:
    engine, _ = recording_engine("llama")
    assert engine.decode_attention == "native"
