"""Engine edge cases: per-item errors, logprobs through the engine, info, sizing, devices."""

from __future__ import annotations

import math
import os

import pytest
import torch

from common.types import SamplingParams
from common.step import NewSequence, StepBatch, WorkItem, StepError
from services.worker.engine.device import resolve_device, resolve_dtype
from tests.unit.worker.engine_helpers import Driver, generate, make_engine, prompt_of, reference_model


def test_bad_work_items_fail_alone_and_change_nothing() -> None:
    engine = make_engine("gemma3", max_model_len=12)
    batch = StepBatch(
        new_sequences=[NewSequence("ok", prompt_of(5)), NewSequence("empty", []),
                       NewSequence("huge", prompt_of(13))],
        work=[WorkItem("ok", 100), WorkItem("ghost", 4), WorkItem("ok", 1), WorkItem("empty", 4),
              WorkItem("huge", 4)])
    out = engine.step(batch)
    engine.check_invariants()
    assert [(r.seq_id, r.error) for r in out.results] == [
        ("ok", ""), ("ghost", StepError.UNKNOWN_SEQUENCE), ("ok", StepError.DUPLICATE_WORK), ("empty", StepError.NOTHING_TO_COMPUTE),
        ("huge", StepError.EXCEEDS_MAX_MODEL_LEN)]
    assert out.results[0].sampled and out.batch_tokens == 5
    out = engine.step(StepBatch(work=[WorkItem("ok", 0)]))
    assert [(r.error, r.num_computed_tokens) for r in out.results] == [(StepError.INVALID_NUM_TOKENS, 5)]
    assert engine.running_sequences() == 3
    engine.step(StepBatch(free_seq_ids=["ok", "empty", "huge", "never-registered"]))
    assert engine.running_sequences() == 0
    assert engine.pool_stats().used_blocks == 0


def test_prefill_chunk_reports_progress_without_sampling() -> None:
    engine = make_engine("llama")
    out = engine.step(StepBatch(new_sequences=[NewSequence("a", prompt_of(10))], work=[WorkItem("a", 4)]))
    result = out.results[0]
    assert (result.num_computed_tokens, result.sampled, result.token_id, out.batch_tokens) == (4, False, -1, 4)
    out = engine.step(StepBatch(work=[WorkItem("a", 100)]))
    assert (out.results[0].num_computed_tokens, out.results[0].sampled) == (10, True)
    out = engine.step(StepBatch(work=[WorkItem("a", 100)]))
    assert (out.results[0].num_computed_tokens, out.batch_tokens) == (11, 1)


def test_logprobs_match_the_reference_distribution() -> None:
    engine = make_engine("gemma3")
    reference = reference_model("gemma3")
    prompt = prompt_of(9, 3)
    params = SamplingParams(logprobs=True, top_logprobs=3)
    out = engine.step(StepBatch(new_sequences=[NewSequence("a", prompt, [], params)], work=[WorkItem("a", 100)]))
    result = out.results[0]
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1], dim=-1)
    assert result.logprob is not None
    assert math.isclose(result.logprob.logprob, float(expected[result.token_id]), abs_tol=1e-4)
    assert [top.token_id for top in result.logprob.top] == expected.topk(3).indices.tolist()
    assert result.logprob.top[0].token_id == result.token_id     # greedy picks the most likely token


def test_prefix_caching_can_be_disabled() -> None:
    engine = make_engine("gemma3", enable_prefix_caching=False)
    driver = Driver(engine)
    prompt = prompt_of(17, 4)
    first = driver.run({"a": prompt}, 3)["a"]
    second = driver.run({"b": prompt}, 3)["b"]
    assert first == second
    assert driver.cached == {}
    assert engine.drain_events() == [] and engine.snapshot_chains() == []
    assert engine.pool_stats().cached_blocks == 0


@pytest.mark.parametrize("kind", ["qwen3", "qwen2_sliding"])
def test_other_architectures_match_generate(kind: str) -> None:
    reference = reference_model(kind)
    prompts = {"a": prompt_of(3, 1), "b": prompt_of(20, 2), "c": prompt_of(13, 3)}
    got = Driver(make_engine(kind)).run(prompts, 8, {"b": 6, "c": 4})
    for seq_id, prompt in prompts.items():
        expected = generate(reference, prompt, 8)
        assert got[seq_id][:len(expected)] == expected, seq_id


def test_info_describes_the_engine() -> None:
    engine = make_engine("gemma3", num_blocks=32, block_size=8)
    info = engine.info
    assert (info.block_size, info.num_blocks, info.device, info.dtype) == (8, 32, "cpu", "float32")
    assert info.eos_token_ids == [1] and info.vocab_size == 384
    assert info.max_model_len == 1024            # from max_position_embeddings, under the CPU cap
    assert info.model_name == "gemma3"


def test_default_pool_size_comes_from_the_kv_byte_budget() -> None:
    engine = make_engine("gemma3", num_blocks=0, block_size=4, cpu_kv_bytes=1 << 20, kv_hybrid=False)
    # 4 layers x K and V x 1 KV head x 16 dims x 4 bytes x 4 tokens per block = 2 KiB per block.
    assert engine.info.num_blocks == (1 << 20) // 2048
    assert engine.kv.nbytes() == engine.info.num_blocks * 2048


def test_the_hybrid_layout_gives_the_sliding_layers_half_the_byte_budget() -> None:
    engine = make_engine("gemma3", num_blocks=0, block_size=4, cpu_kv_bytes=1 << 20)
    # 3 sliding layers x 512 bytes a block, 1 full layer x 512: the sliding group gets half.
    sliding = (1 << 19) // 1536
    assert engine.kv_layout.sliding_blocks == sliding and engine.kv_layout.window == 8
    assert engine.info.num_blocks == ((1 << 20) - sliding * 1536) // 512
    assert engine.kv.nbytes() <= 1 << 20
    assert engine.kv.nbytes() == engine.info.num_blocks * 512 + sliding * 1536


def test_device_and_dtype_resolution() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto").type in ("cpu", "mps")
        with pytest.raises(ValueError):
            resolve_device("cuda")
    with pytest.raises(ValueError):
        resolve_device("tpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError):
        resolve_dtype("int3", torch.device("cpu"))


def test_unknown_eviction_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="eviction policy"):
        make_engine("llama", eviction_policy="fifo")


def test_memory_fraction_sizes_the_pool_from_available_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.worker.engine.kv import sizing

    monkeypatch.setattr(sizing, "free_device_memory", lambda device: 64 << 20)
    engine = make_engine("gemma3", num_blocks=0, block_size=4, kv_memory_fraction=0.25)
    # A quarter of 64 MiB, half of it for the sliding group (see above).
    assert engine.kv.nbytes() <= 16 << 20 < engine.kv.nbytes() + 1536
    assert engine.kv_layout.sliding_blocks == (8 << 20) // 1536


def test_available_host_memory_is_positive() -> None:
    from services.worker.engine.device import available_host_memory, free_device_memory

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < available_host_memory() <= total
    assert 0 < free_device_memory(torch.device("cpu")) <= total
