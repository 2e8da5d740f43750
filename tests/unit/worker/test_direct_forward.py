"""The base model's forward written out (direct_forward.py) against transformers' own:
bitwise the same logits with transformers' RoPE, within float32 rounding with the C one,
the same greedy tokens as `generate` either way, on every layer family it covers; any
other model keeps transformers' forward. The last layer finishes only the rows that sample
(a prompt's logprobs keep every row), and the cache it leaves is the full forward's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.worker.engine.cpu.direct_forward import DirectForward, _native_rope_agrees
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.kernels.native_ops import load_elementwise
from common.step import NewSequence, StepBatch, WorkItem
from common.types import SamplingParams
from tests.unit.worker.engine_helpers import (
    Driver,
    assert_greedy_matches,
    prompt_of,
    recording_engine,
    reference_model,
)

PROMPTS = {"short": prompt_of(3, 1), "mid": prompt_of(9, 2), "long": prompt_of(30, 3), "odd": prompt_of(17, 4)}
CHUNKS = {"short": 64, "mid": 4, "long": 7, "odd": 5}      # prefill chunks beside decodes


@pytest.fixture(scope="module", params=["gemma3", "llama", "qwen3", "qwen2_sliding"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def _rows(kind: str, **config) -> tuple[str, list[torch.Tensor], dict[str, list[int]]]:
    engine, recorder = recording_engine(kind, **config)
    tokens = Driver(engine).run(PROMPTS, 8, CHUNKS)
    return engine.direct_forward, [logits for logits, _ in recorder.rows], tokens


def test_without_the_c_ops_the_logits_are_transformers_bitwise(kind: str) -> None:
    mode, direct, direct_tokens = _rows(kind, cpu_native_kernels="off")
    plain_mode, plain, plain_tokens = _rows(kind, cpu_native_kernels="off", direct_forward="off")
    assert (mode, plain_mode) == ("direct", "transformers")
    assert direct_tokens == plain_tokens
    assert len(direct) == len(plain) == 32
    assert all(torch.equal(a, b) for a, b in zip(direct, plain))


def test_with_the_c_rope_the_tokens_are_generates(kind: str) -> None:
    mode, direct, tokens = _rows(kind)
    _, plain, plain_tokens = _rows(kind, direct_forward="off")
    assert mode == "direct (native RoPE)"
    assert tokens == plain_tokens
    assert_greedy_matches(reference_model(kind), PROMPTS, tokens, 8)
    for a, b in zip(direct, plain):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("other", ["gemma4"])
def test_other_layer_classes_keep_transformers_forward(other: str) -> None:
    engine, _ = recording_engine(other)
    assert engine.direct_forward == "transformers"
    assert DirectForward.create(engine.prepared.base) is None


def test_the_c_rope_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    native = load_elementwise(default_cache_dir())
    assert native is not None, "the C ops did not build (is there a C compiler?)"
    assert _native_rope_agrees(native, apply_rotary_pos_emb, 256)
    assert _native_rope_agrees(native, apply_rotary_pos_emb, 18)      # a head size not a multiple of 16
    assert not _native_rope_agrees(native, apply_rotary_pos_emb, 7)    # odd: no halves to rotate
    wrong = lambda q, k, cos, sin: (q * cos, k * cos)                 # noqa: E731 - not a RoPE
    assert not _native_rope_agrees(native, wrong, 16)
    with pytest.raises(ValueError, match="rope"):
        native.rope(torch.zeros(2, 4, 8), torch.zeros(3, 1, 8), torch.zeros(2, 8), torch.zeros(2, 8))


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="direct forward"):
        recording_engine("llama", direct_forward="on")


def _rows_into_o_proj(engine) -> list[list[int]]:
    """The rows each layer's output projection multiplies, a list per step."""
    seen: list[list[int]] = []
    direct = engine.forward.direct

    def recorded(index: int, o_proj):
        def o_proj_recorded(x: torch.Tensor) -> torch.Tensor:
            if index == 0:
                seen.append([])
            seen[-1].append(x.shape[-2])
            return o_proj(x)
        return o_proj_recorded

    direct._steps = [dataclasses.replace(steps, o_proj=recorded(index, steps.o_proj))
                     for index, steps in enumerate(direct._steps)]
    return seen


@pytest.mark.parametrize("prompt_logprobs", [False, True])
def test_the_last_layer_finishes_only_the_rows_that_sample(prompt_logprobs: bool) -> None:
    engine, _ = recording_engine("gemma3", cpu_native_kernels="off")
    seen = _rows_into_o_proj(engine)
    layers = len(engine.prepared.base.layers)
    prompts = {"a": prompt_of(30, 3), "b": prompt_of(9, 2)}
    driver = Driver(engine)
    params = SamplingParams(prompt_logprobs=prompt_logprobs, logprobs=prompt_logprobs)
    driver.step(StepBatch(new_sequences=[NewSequence(seq_id, prompt, [], params) for seq_id, prompt in prompts.items()],
                          work=[WorkItem("a", 12), WorkItem("b", 1024)]))   # a's first chunk, b whole
    rows = 12 + 9
    # Every layer but the last multiplies every row; the last only b's final row (a's chunk
    # does not end its prompt), unless prompt logprobs read every row's final hidden state.
    assert seen[-1] == [rows] * (layers - 1) + [rows if prompt_logprobs else 1]
    driver.step(StepBatch(work=[WorkItem("a", 1024), WorkItem("b", 1)]))     # a's rest, b decodes
    assert seen[-1][-1] == (18 + 1 if prompt_logprobs else 2)


def test_the_cache_and_tokens_are_the_full_forwards() -> None:
    """Pruned and unpruned (transformers' forward, which computes every row) leave the same
    keys and values behind, so later steps see the same context."""
    caches = []
    for mode in ("auto", "off"):
        engine, _ = recording_engine("gemma3", cpu_native_kernels="off", direct_forward=mode)
        driver = Driver(engine)
        tokens = driver.run({"long": PROMPTS["long"]}, 4, {"long": 7}, free_at_end=False)
        caches.append((tokens, [cache for cache in (*engine.kv.keys, *engine.kv.values) if cache is not None]))
    (tokens, cache), (plain_tokens, plain_cache) = caches
    assert tokens == plain_tokens
    assert len(cache) == len(plain_cache) > 0
    assert all(torch.equal(a, b) for a, b in zip(cache, plain_cache))
