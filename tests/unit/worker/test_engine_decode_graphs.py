"""Decode graphs: decode-only steps replayed from captured (batch, context) buckets.

Without a GPU the capture is `EagerCapture`, which replays by running the captured
function again; that exercises everything but the CUDA recording itself: static
buffers, padding rows writing into the scratch block, bucketed context with masks,
the capture check and the fall-back to eager. The CUDA test at the end runs only
where a GPU is present."""

from __future__ import annotations

import copy

import pytest
import torch

from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.cuda import decode_graphs
from services.worker.engine.cuda.decode_graphs import (
    CudaGraphCapture,
    DecodeGraphs,
    EagerCapture,
    batch_buckets,
    context_buckets,
    row_relative_error,
)
from services.worker.wiring import build_engine
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


@pytest.fixture(scope="module", params=["gemma3", "gemma4", "llama"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(autouse=True)
def small_context_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiny prompts cross several context buckets: 8, 16, 32, 64, ...
    monkeypatch.setattr(decode_graphs, "MIN_CONTEXT_BUCKET", 8)


class CountingCapture(EagerCapture):
    def __init__(self) -> None:
        self.captures = 0

    def capture(self, fn):
        self.captures += 1
        return super().capture(fn)


class CorruptingCapture:
    """A capture whose replay does not reproduce the function (a broken graph)."""

    def capture(self, fn):
        return lambda: fn() + 1.0


class FailingCapture:
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


class FreezingCapture:
    """Replays the output of the inputs it was captured with, whatever the buffers hold
    now: what a graph that baked in a host-side value of its first inputs would do."""

    def capture(self, fn):
        frozen = fn().clone()
        return lambda: frozen


class BreaksAfterCheckCapture:
    """Passes the capture check, then every later replay raises."""

    def capture(self, fn):
        replays = []

        def replay():
            replays.append(1)
            if len(replays) > 1:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return fn()

        return replay


def graph_engine(kind: str, capture=None, num_blocks: int = 128, block_size: int = 4, **config) -> Engine:
    model = build_model(copy.deepcopy(CONFIGS[kind]()))
    return build_engine(EngineConfig(model_dir="", num_blocks=num_blocks, block_size=block_size, model_key=kind,
                                     cuda_graph_max_batch=config.pop("cuda_graph_max_batch", 8), **config),
                        model=model, graph_capture=capture if capture is not None else EagerCapture())


PROMPTS = {"a": prompt_of(3, 1), "b": prompt_of(9, 2), "c": prompt_of(30, 3)}
CHUNKS = {"a": 64, "b": 4, "c": 7}


def test_greedy_tokens_and_logits_match_transformers(kind: str) -> None:
    engine = graph_engine(kind)
    recorder = RecordingSampler(engine.sampler)
    engine.sampler = recorder
    got = Driver(engine).run(PROMPTS, 14, CHUNKS)
    reference = reference_model(kind)
    assert_greedy_matches(reference, PROMPTS, got, 14)
    assert_rows_match(reference, recorder, LOGITS_ATOL)
    graphs = engine.graphs
    assert graphs is not None and graphs.enabled and graphs.failure == ""
    assert graphs.replays > 10
    assert engine.pool_stats().used_blocks == 0


def test_buckets_are_captured_once_each_and_padding_rows_leave_other_sequences_alone() -> None:
    capture = CountingCapture()
    with_graphs = graph_engine("gemma3", capture)
    without = build_engine(EngineConfig(model_dir="", num_blocks=128, block_size=4, model_key="gemma3"),
                           model=build_model(copy.deepcopy(CONFIGS["gemma3"]())))
    assert without.graphs is None
    # Three sequences ride in a batch-4 bucket: one padding row every decode step.
    ours = Driver(with_graphs).run(PROMPTS, 20, CHUNKS)
    theirs = Driver(without).run(PROMPTS, 20, CHUNKS)
    assert ours == theirs
    graphs = with_graphs.graphs
    assert graphs is not None
    # Contexts grow from 4 to 49 tokens: context buckets 8, 16, 32, 64; batches of 1 to 3 rows.
    keys = set(graphs._graphs)
    assert {context for _, context in keys} <= {8, 16, 32, 64}
    assert {batch for batch, _ in keys} <= {1, 2, 4}
    assert (4, 64) in keys
    assert capture.captures == len(keys) == graphs.captured


def test_scratch_block_is_outside_the_pool() -> None:
    engine = graph_engine("llama", num_blocks=16)
    assert engine.pool.num_blocks == 16
    assert engine.info.num_blocks == 16
    layer_cache = next(cache for cache in engine.kv.keys if cache is not None)
    assert layer_cache.shape[0] == 17 * engine.block_size
    assert engine.graphs is not None and engine.graphs.scratch_block == 16
    # Filling the whole pool still decodes: no sequence's block is the scratch block.
    prompts = {f"s{i}": prompt_of(7, i) for i in range(4)}        # 2 blocks each, 3 with the outputs
    driver = Driver(engine)
    got = driver.run(prompts, 5, free_at_end=False)
    assert engine.pool_stats().used_blocks == 12
    reference = reference_model("llama")
    for seq_id, prompt in prompts.items():
        assert got[seq_id] == generate(reference, prompt, 5)


def test_only_decode_only_steps_replay_and_large_batches_run_eagerly() -> None:
    engine = graph_engine("gemma3", cuda_graph_max_batch=2)
    graphs = engine.graphs
    assert graphs is not None
    driver = Driver(engine)
    new = [NewSequence(seq_id, prompt) for seq_id, prompt in PROMPTS.items()]
    driver.step(StepBatch(new_sequences=new, work=[WorkItem(seq_id, 64) for seq_id in PROMPTS]))
    assert graphs.replays == 0
    # Three decodes exceed the largest bucket (2): eager.
    driver.step(StepBatch(work=[WorkItem(seq_id, 1) for seq_id in PROMPTS]))
    assert graphs.replays == 0
    # Two decodes beside a prefill chunk: eager, since the step is not decode-only.
    driver.step(StepBatch(new_sequences=[NewSequence("d", prompt_of(12, 9))],
                          work=[WorkItem("a", 1), WorkItem("b", 1), WorkItem("d", 5)]))
    assert graphs.replays == 0
    # A non-final prefill chunk of one token does not sample: eager.
    driver.step(StepBatch(work=[WorkItem("d", 1)]))
    assert graphs.replays == 0
    driver.step(StepBatch(work=[WorkItem("a", 1), WorkItem("b", 1)]))
    assert graphs.replays == 1


@pytest.mark.parametrize("capture, reason, replays", [
    (CorruptingCapture(), "differs from the eager forward", 0),
    (FailingCapture(), "capturing batch", 0),
    (BreaksAfterCheckCapture(), "replaying batch", 1),
    (FreezingCapture(), "on new inputs differs from the eager forward", 1),
])
def test_a_capture_that_fails_or_does_not_reproduce_turns_graphs_off(capture, reason: str, replays: int) -> None:
    engine = graph_engine("gemma3", capture)
    got = Driver(engine).run(PROMPTS, 8, CHUNKS)
    graphs = engine.graphs
    assert graphs is not None
    assert not graphs.enabled and reason in graphs.failure
    assert graphs.replays == replays and graphs.captured == 0
    assert_greedy_matches(reference_model("gemma3"), PROMPTS, got, 8)


def test_cpu_ignores_use_cuda_graphs() -> None:
    engine = build_engine(EngineConfig(model_dir="", num_blocks=8, block_size=4, use_cuda_graphs=True),
                          model=build_model(copy.deepcopy(CONFIGS["llama"]())))
    assert engine.device.type == "cpu" and engine.graphs is None


def test_bucket_lists() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert context_buckets(8192, 16) == [256, 512, 1024, 2048, 4096, 8192]
    assert context_buckets(1000, 16) == [256, 512, 1008]
    assert context_buckets(100, 16) == [112]
    assert context_buckets(40, 6, smallest=8) == [12, 18, 36, 42]


def test_bucket_choice() -> None:
    graphs = DecodeGraphs(lambda ids, pos, meta: ids, kv=None, cache_layer=[], capture=EagerCapture(),  # type: ignore[arg-type]
                          block_size=16, scratch_block=0, max_batch=32, max_context=4096,
                          device=torch.device("cpu"), min_context=256)
    assert graphs.bucket(1, 1) == (1, 256)
    assert graphs.bucket(3, 257) == (4, 512)
    assert graphs.bucket(32, 4096) == (32, 4096)
    assert graphs.bucket(33, 10) is None
    assert graphs.bucket(1, 4097) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_match_transformers_on_a_gpu() -> None:
    for kind in ("gemma3", "llama"):
        model = build_model(copy.deepcopy(CONFIGS[kind]()))
        engine = build_engine(EngineConfig(model_dir="", device="cuda", dtype="float32", num_blocks=128, block_size=4,
                                           model_key=kind), model=model)
        assert isinstance(engine.graphs._capture, CudaGraphCapture)  # type: ignore[union-attr]
        got = Driver(engine).run(PROMPTS, 14, CHUNKS)
        assert_greedy_matches(reference_model(kind), PROMPTS, got, 14)
        assert engine.graphs.enabled, engine.graphs.failure  # type: ignore[union-attr]
        assert engine.graphs.replays > 10  # type: ignore[union-attr]


def test_row_relative_error_tolerates_rounding_but_not_a_wrong_row() -> None:
    torch.manual_seed(0)
    expected = torch.randn(4, 64) * 50
    rounded = expected.to(torch.bfloat16).float()
    assert row_relative_error(rounded, expected) < 0.01
    wrong_row = expected.clone()
    wrong_row[2] = torch.randn(64) * 50
    assert row_relative_error(wrong_row, expected) > 0.5
    assert row_relative_error(expected[:3], expected) == float("inf")


def test_contexts_past_the_graph_limit_run_eagerly() -> None:
    engine = graph_engine("llama", cuda_graph_max_context=16)
    graphs = engine.graphs
    assert graphs is not None and graphs.context_buckets == [8, 16]
    prompt = prompt_of(14, 3)
    got = Driver(engine).run({"a": prompt}, 8)
    assert got["a"] == generate(reference_model("llama"), prompt, 8)
    # Contexts 15 and 16 replay; from 17 on the steps run eagerly.
    assert graphs.replays == 2 and graphs.enabled
