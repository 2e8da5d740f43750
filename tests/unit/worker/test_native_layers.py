"""A decode step's layers in one C call (native_layers.py): bitwise the logits of the
Python layers it replaces, the same greedy tokens as `generate`, taken only for decode
steps it can run, and left out wherever a piece of a layer is not a C kernel."""

from __future__ import annotations

import copy

import pytest
import torch

from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu.kernels.native_layers import NativeDecodeLayers
from services.worker.wiring import build_engine
from tests.fixtures.tiny_model import build_model
from tests.unit.worker.engine_helpers import (
    CONFIGS,
    Driver,
    RecordingSampler,
    assert_greedy_matches,
    prompt_of,
)
from tests.unit.worker.test_weight_codes import snap_to_codes

PROMPTS = {"short": prompt_of(3, 1), "mid": prompt_of(9, 2), "long": prompt_of(30, 3), "odd": prompt_of(17, 4)}
CHUNKS = {"short": 64, "mid": 4, "long": 7, "odd": 5}      # prefill chunks beside decodes


@pytest.fixture(scope="module")
def coded_gemma3() -> torch.nn.Module:
    model = build_model(CONFIGS["gemma3"]())
    assert snap_to_codes(model) > 0
    return model


def _engine(model: torch.nn.Module, **config) -> tuple[Engine, RecordingSampler]:
    engine = build_engine(EngineConfig(model_dir="", num_blocks=128, block_size=4, model_key="layers", **config),
                          model=copy.deepcopy(model))
    recorder = RecordingSampler(engine.sampler)
    engine.sampler = recorder
    return engine, recorder


class CountingLayers:
    """Wraps the C layers and counts the steps they ran."""

    def __init__(self, inner: NativeDecodeLayers) -> None:
        self.inner, self.steps = inner, 0

    def takes(self, meta, rows: int) -> bool:
        return self.inner.takes(meta, rows)

    def __call__(self, hidden, rotary, meta) -> None:
        self.steps += 1
        self.inner(hidden, rotary, meta)


def test_the_c_layers_give_the_python_layers_logits_bitwise(coded_gemma3: torch.nn.Module) -> None:
    engine, recorder = _engine(coded_gemma3)
    assert engine.direct_forward == "direct (C decode layers)"
    counting = CountingLayers(engine.forward.direct.native_layers)
    engine.forward.direct.native_layers = counting
    python, python_recorder = _engine(coded_gemma3)
    python.forward.direct.native_layers = None
    assert python.direct_forward == "direct (native RoPE)"
    tokens = Driver(engine).run(PROMPTS, 10, CHUNKS)
    assert Driver(python).run(PROMPTS, 10, CHUNKS) == tokens
    assert counting.steps > 0                     # the decode-only steps, once every prompt is in
    assert len(recorder.rows) == len(python_recorder.rows) == 40
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(recorder.rows, python_recorder.rows))
    assert_greedy_matches(coded_gemma3, PROMPTS, tokens, 10)


def test_steps_with_prefill_chunks_or_too_many_rows_keep_the_python_layers(coded_gemma3: torch.nn.Module) -> None:
    engine, _ = _engine(coded_gemma3)
    layers = engine.forward.direct.native_layers
    assert layers is not None
    counting = CountingLayers(layers)
    engine.forward.direct.native_layers = counting
    layers.max_rows = 2                           # 3 decodes a step are more than it takes
    prompts = {"a": prompt_of(5, 1), "b": prompt_of(6, 2), "c": prompt_of(7, 3)}
    tokens = Driver(engine).run(prompts, 6)
    assert counting.steps == 0
    assert_greedy_matches(coded_gemma3, prompts, tokens, 6)


@pytest.mark.parametrize("config", [{"cpu_weight_codes": "off"}, {"cpu_native_kernels": "off"},
                                    {"decode_attention": "sdpa"}])
def test_without_every_c_piece_the_python_layers_serve(coded_gemma3: torch.nn.Module, config: dict) -> None:
    engine, _ = _engine(coded_gemma3, **config)
    layers = engine.forward.direct.native_layers if engine.forward.direct is not None else None
    if layers is not None:                         # built, but the step's attention is not native
        counting = CountingLayers(layers)
        engine.forward.direct.native_layers = counting
    prompts = {"a": prompt_of(5, 1), "b": prompt_of(9, 2)}
    tokens = Driver(engine).run(prompts, 6)
    assert layers is None or counting.steps == 0
    assert_greedy_matches(coded_gemma3, prompts, tokens, 6)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_other_layer_shapes_keep_the_python_layers(kind: str) -> None:
    model = build_model(CONFIGS[kind]())
    snap_to_codes(model)
    engine, _ = _engine(model)
    assert engine.coded_linears > 0
    assert engine.forward.direct.native_layers is None


def test_random_weights_keep_the_python_layers() -> None:
    engine, _ = _engine(build_model(CONFIGS["gemma3"]()))
    assert engine.forward.direct.native_layers is None
