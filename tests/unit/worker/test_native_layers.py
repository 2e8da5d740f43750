"""A decode step's layers in one C call (native_layers.py), and a step of few prefill rows:
bitwise the logits of the Python layers they replace, the same greedy tokens as `generate`,
taken only for steps they can run (few rows: decodes, prefill chunks unscored, or both), and left
out wherever a piece of a layer is not a C kernel."""

from __future__ import annotations

import copy

import pytest
import torch

from common.step import KvPolicy, NewSequence, StepBatch, WorkItem
from common.types import SamplingParams
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


@pytest.fixture(scope="module")
def coded_gemma3_wide_heads() -> torch.nn.Module:
    """Heads of 32: q, k and v fill whole panels of the codes, so the C layers read them joined
    (coded_groups.py); with heads of 16 (above) k and v do not, and only gate and up are."""
    model = build_model(CONFIGS["gemma3"](head_dim=32))
    assert snap_to_codes(model) > 0
    return model


def _engine(model: torch.nn.Module, num_blocks: int = 128, **config) -> tuple[Engine, RecordingSampler]:
    engine = build_engine(EngineConfig(model_dir="", num_blocks=num_blocks, block_size=4, model_key="layers", **config),
                          model=copy.deepcopy(model))
    recorder = RecordingSampler(engine.sampler)
    engine.sampler = recorder
    return engine, recorder


class CountingLayers:
    """Wraps the C layers and counts the decode steps and the prefill steps they ran."""

    def __init__(self, inner: NativeDecodeLayers) -> None:
        self.inner, self.steps, self.prefill_steps = inner, 0, 0
        self.rows: list[int] = []           # each decode-only step's rows

    def takes(self, meta, rows: int) -> bool:
        return self.inner.takes(meta, rows)

    def __call__(self, hidden, rotary, meta, *args, **kwargs) -> torch.Tensor:
        if meta.prefills:
            self.prefill_steps += 1
        else:
            self.steps += 1
            self.rows.append(hidden.shape[0])
        return self.inner(hidden, rotary, meta, *args, **kwargs)


@pytest.mark.parametrize("heads", ["16", "32"])
def test_the_c_layers_give_the_python_layers_logits_bitwise(heads: str, request: pytest.FixtureRequest) -> None:
    coded_gemma3 = request.getfixturevalue("coded_gemma3" if heads == "16" else "coded_gemma3_wide_heads")
    engine, recorder = _engine(coded_gemma3)
    assert engine.direct_forward == "direct (C decode layers)"
    joined = [(bool(layer.qkv.codes), bool(layer.gate_up.codes)) for layer in engine.forward.direct.native_layers._layers]
    assert joined == [(heads == "32", True)] * len(joined)
    counting = CountingLayers(engine.forward.direct.native_layers)
    engine.forward.direct.native_layers = counting
    python, python_recorder = _engine(coded_gemma3)
    python.forward.direct.native_layers = None
    assert python.direct_forward == "direct (native RoPE)"
    tokens = Driver(engine).run(PROMPTS, 10, CHUNKS)
    assert Driver(python).run(PROMPTS, 10, CHUNKS) == tokens
    assert counting.steps > 0                     # the decode-only steps, once every prompt is in
    assert counting.prefill_steps == 5            # every step with chunks: the first (19 rows), then
                                                  # four with chunks beside decodes
    assert len(recorder.rows) == len(python_recorder.rows) == 40
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(recorder.rows, python_recorder.rows))
    assert_greedy_matches(coded_gemma3, PROMPTS, tokens, 10)


def _cached_prompt_steps(engine: Engine) -> dict[str, list[int]]:
    """A 41-token prompt, freed (its blocks stay cached), then two prompts sharing its first 36
    tokens: each prefills its few new tokens over a cached context five times the tiny model's
    sliding window, in a step of prefill chunks alone; then both decode."""
    driver = Driver(engine)
    first = prompt_of(41, 7)
    driver.run({"first": first}, 2)
    later = {"again": first[:36] + prompt_of(6, 8)[1:], "other": first[:37] + prompt_of(4, 9)[1:]}
    tokens = driver.run(later, 5)
    assert driver.cached["again"] >= 32 and driver.cached["other"] >= 32
    return tokens


def test_one_sequences_decodes_read_the_joined_codes_in_place_bitwise(coded_gemma3_wide_heads: torch.nn.Module
                                                                      ) -> None:
    """One row: q, k and v (and gate and up) come out of one call each straight into their own
    room of the scratch; the logits are the Python layers' bit for bit, with drafts too (rows > 1)."""
    engine, recorder = _engine(coded_gemma3_wide_heads)
    counting = CountingLayers(engine.forward.direct.native_layers)
    engine.forward.direct.native_layers = counting
    python, python_recorder = _engine(coded_gemma3_wide_heads)
    python.forward.direct.native_layers = None
    prompt = {"one": prompt_of(9, 2) * 3}
    tokens = Driver(engine).run(prompt, 12, draft_tokens=3)
    assert Driver(python).run(prompt, 12, draft_tokens=3) == tokens
    assert 1 in counting.rows and max(counting.rows) > 1      # one row, and a decode with its drafts
    assert len(recorder.rows) == len(python_recorder.rows)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(recorder.rows, python_recorder.rows))


def test_a_cached_prompts_new_tokens_run_in_the_c_layers_bitwise(coded_gemma3: torch.nn.Module) -> None:
    engine, recorder = _engine(coded_gemma3)
    counting = CountingLayers(engine.forward.direct.native_layers)
    engine.forward.direct.native_layers = counting
    python, python_recorder = _engine(coded_gemma3)
    python.forward.direct.native_layers = None
    tokens = _cached_prompt_steps(engine)
    assert _cached_prompt_steps(python) == tokens
    assert engine.forward.direct.native_layers.inner.max_rows < 41
    assert counting.prefill_steps == 1            # the two cached prompts' new rows together (the first
                                                  # prompt's 41 rows are more than the C layers take)
    assert len(recorder.rows) == len(python_recorder.rows)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(recorder.rows, python_recorder.rows))


def test_prompt_logprobs_from_the_c_layers_are_the_python_layers(coded_gemma3: torch.nn.Module) -> None:
    """A prompt scored token by token reads every row's hidden state, which the C layers give
    as the Python layers do (they run the last layer for every row)."""
    prompts = {"a": prompt_of(9, 1), "b": prompt_of(12, 2)}
    sampling = {name: SamplingParams(prompt_logprobs=True, logprobs=True) for name in prompts}
    runs = []
    for native in (True, False):
        engine, _ = _engine(coded_gemma3)
        counting = CountingLayers(engine.forward.direct.native_layers)
        engine.forward.direct.native_layers = counting if native else None
        driver = Driver(engine)
        tokens = driver.run(prompts, 3, sampling=sampling)
        scored = [(r.seq_id, r.prompt_logprobs) for out in driver.steps for r in out.results if r.prompt_logprobs]
        assert len(scored) == 2
        runs.append((tokens, scored, counting.prefill_steps))
    assert runs[0][:2] == runs[1][:2]
    assert runs[0][2] == 1


def test_a_prefill_chunk_beside_decodes_runs_in_the_c_layers(coded_gemma3: torch.nn.Module) -> None:
    """A step of a decode and a new prompt's chunk: the decode through the decode attention, the
    chunk through the prefill attention, in one C call (the logits: the bitwise test above)."""
    engine, _ = _engine(coded_gemma3)
    counting = CountingLayers(engine.forward.direct.native_layers)
    engine.forward.direct.native_layers = counting
    driver = Driver(engine)
    driver.step(StepBatch(new_sequences=[NewSequence("a", prompt_of(5, 1))], work=[WorkItem("a", 64)]))
    driver.step(StepBatch(new_sequences=[NewSequence("b", prompt_of(6, 2))],
                          work=[WorkItem("a", 1), WorkItem("b", 64)]))
    assert (counting.prefill_steps, counting.steps) == (2, 0)
    layers = engine.forward.direct.native_layers.inner
    layers.max_rows = 6                           # 1 decode + 6 prompt rows: more than it takes
    driver.step(StepBatch(new_sequences=[NewSequence("c", prompt_of(6, 3))],
                          work=[WorkItem("a", 1), WorkItem("b", 1), WorkItem("c", 64)]))
    assert counting.prefill_steps == 2


def test_a_long_decode_beside_a_chunk_splits_its_context_as_the_python_layers_do(
        coded_gemma3: torch.nn.Module) -> None:
    """One decode over 600 tokens beside a new prompt's chunk: the decode attention splits that
    context over the threads as the Python path's call does for its one decode row (not for the
    step's rows), so the logits stay bitwise the Python layers'."""
    runs = []
    for native in (True, False):
        engine, recorder = _engine(coded_gemma3, num_blocks=320)
        counting = CountingLayers(engine.forward.direct.native_layers)
        engine.forward.direct.native_layers = counting if native else None
        driver = Driver(engine)
        driver.step(StepBatch(new_sequences=[NewSequence("long", prompt_of(600, 4))], work=[WorkItem("long", 1024)]))
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            driver.step(StepBatch(new_sequences=[NewSequence("new", prompt_of(7, 5))],
                                  work=[WorkItem("long", 1), WorkItem("new", 64)]))
        finally:
            torch.set_num_threads(before)
        runs.append(([row for row, _ in recorder.rows], counting.prefill_steps))
    assert runs[0][1] == 1                        # the mixed step, 8 rows, in C
    assert len(runs[0][0]) == len(runs[1][0]) == 3
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))


def test_a_prefill_step_whose_attention_is_scored_keeps_the_python_layers(coded_gemma3: torch.nn.Module) -> None:
    """H2O sums each layer's attention over a sequence's blocks from the Python path's
    attention calls; the C layers do not report it, so such a step is not theirs."""
    engine, _ = _engine(coded_gemma3)
    counting = CountingLayers(engine.forward.direct.native_layers)
    engine.forward.direct.native_layers = counting
    scored = NewSequence("s", tuple(prompt_of(10, 6)), (), SamplingParams(), kv_policy=KvPolicy("h2o", 64))
    Driver(engine).step(StepBatch(new_sequences=[scored], work=[WorkItem("s", 64)]))
    assert counting.prefill_steps == 0
    config = engine.model_config
    assert sum(engine.sequences.get("s").block_scores) == pytest.approx(
        config.num_hidden_layers * config.num_attention_heads, rel=1e-4)


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
