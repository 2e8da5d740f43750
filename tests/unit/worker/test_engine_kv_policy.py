"""Lossy KV policies (kv_policy.py) on tiny models: the cache stays within its budget while
a sequence runs far past it, and every sampled row's logits equal those of a streaming
reference: transformers decoding token by token with its own KV cache, from which the same
blocks are dropped and whose later keys are moved to the freed positions (StreamingLLM:
positions count from the cache's start; cached K/V are never recomputed)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from common.step import KvPolicy, NewSequence, StepBatch, WorkItem
from common.types import SamplingParams
from services.worker.engine.kv.kv_rotation import _rotate_half
from tests.unit.worker.engine_helpers import RecordingSampler, make_engine, prompt_of

ATOL = 1e-4
BLOCK = 4


def run(kind: str, policy: KvPolicy, prompt: list[int], new_tokens: int, chunk: int = 1024, **config):
    """Runs one greedy sequence; per sampled row: (logits, the tokens before it)."""
    engine = make_engine(kind, block_size=BLOCK, **config)
    recorder = RecordingSampler(engine.sampler)
    engine.sampler = recorder
    new = [NewSequence("s", tuple(prompt), (), SamplingParams(), kv_policy=policy)]
    rows: list[tuple[torch.Tensor, list[int]]] = []
    most_blocks = 0
    outputs = 0
    while outputs < new_tokens:
        seen = len(recorder.rows)
        out = engine.step(StepBatch(new_sequences=new, work=[WorkItem("s", chunk)]))
        new = []
        engine.check_invariants()
        (result,) = out.results
        assert not result.error, result
        seq = engine.sequences.get("s")
        most_blocks = max(most_blocks, len(engine.pool.table("s")))
        if result.sampled:
            outputs += 1
            rows.append(recorder.rows[seen])
    return engine, rows, most_blocks


def streaming_reference(model: torch.nn.Module, tokens: list[int], prompt_len: int, cap: int,
                        sink: int) -> list[torch.Tensor]:
    """The last logits after the prompt and after each later token of `tokens`, decoding one
    token at a time with a cache of at most `cap` tokens: when full, the block after the
    `sink` tokens is dropped and the keys after it move BLOCK positions back."""
    cache = DynamicCache()
    base = model.model
    types = getattr(model.config, "layer_types", None)
    rows = []
    with torch.no_grad():
        out = model(torch.tensor([tokens[:prompt_len]]), cache=cache, use_cache=True)
        rows.append(out.logits[0, -1])
        for token in tokens[prompt_len:]:
            length = cache.get_seq_length()
            if length + 1 > cap:
                _drop_block(base, cache, sink, types)
                length -= BLOCK
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True,
                        position_ids=torch.tensor([[length]]), cache_position=torch.tensor([length]))
            rows.append(out.logits[0, -1])
    return rows


def _drop_block(base: torch.nn.Module, cache: DynamicCache, sink: int, types: list[str] | None) -> None:
    probe = torch.zeros(1, 1, 1)
    for index, layer in enumerate(cache.layers):
        kind = types[index] if types is not None else None
        args = (probe, torch.tensor([[BLOCK]])) + ((kind,) if kind is not None else ())
        cos, sin = (part.reshape(-1) for part in base.rotary_emb(*args))
        keys, values = layer.keys, layer.values
        moved = keys[:, :, sink + BLOCK:]
        moved = moved * cos - _rotate_half(moved) * sin
        layer.keys = torch.cat([keys[:, :, :sink], moved], dim=2)
        layer.values = torch.cat([values[:, :, :sink], values[:, :, sink + BLOCK:]], dim=2)


def assert_rows_match_streaming(reference: torch.nn.Module, rows, prompt_len: int, policy: KvPolicy) -> None:
    tokens = rows[-1][1]
    sink = -(-policy.sink_tokens // BLOCK) * BLOCK if policy.kind == "sink" else 0
    cap = -(-policy.budget_tokens // BLOCK) * BLOCK
    expected = streaming_reference(reference, tokens, prompt_len, cap, sink)
    assert len(expected) == len(rows)
    for (logits, _), want in zip(rows, expected):
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("policy", [KvPolicy("sink", budget_tokens=16, sink_tokens=4),
                                    KvPolicy("window", budget_tokens=16),
                                    KvPolicy("sink", budget_tokens=14, sink_tokens=3)])
def test_decoding_past_the_budget_keeps_what_the_policy_says(kind: str, reference: torch.nn.Module,
                                                            policy: KvPolicy) -> None:
    engine, rows, most_blocks = run(kind, policy, prompt_of(10, 1), 24)
    budget_blocks = -(-policy.budget_tokens // BLOCK)
    assert most_blocks <= budget_blocks
    assert engine.sequences.get("s").evicted >= 24 + 10 - budget_blocks * BLOCK
    assert_rows_match_streaming(reference, rows, 10, policy)


def test_a_prompt_longer_than_the_budget_streams_through_it(kind: str) -> None:
    policy = KvPolicy("sink", budget_tokens=16, sink_tokens=4)
    engine, rows, most_blocks = run(kind, policy, prompt_of(37, 2), 6)
    assert len(rows) == 6 and most_blocks <= 4
    assert engine.sequences.get("s").evicted >= 37 + 6 - 16


def test_a_sequence_runs_past_the_model_context_and_the_pool(kind: str) -> None:
    # 8 blocks of 4 hold 32 tokens; the model's context is set to 24.
    policy = KvPolicy("sink", budget_tokens=16, sink_tokens=4)
    engine, rows, most_blocks = run(kind, policy, prompt_of(10, 3), 40, num_blocks=8, max_model_len=24)
    assert len(rows) == 40 and most_blocks <= 4
    engine.step(StepBatch(free_seq_ids=["s"]))
    assert engine.pool_stats().used_blocks == 0


def test_full_and_an_unreached_budget_change_nothing(kind: str, reference: torch.nn.Module) -> None:
    _, full_rows, _ = run(kind, KvPolicy(), prompt_of(9, 4), 8)
    _, roomy_rows, _ = run(kind, KvPolicy("sink", budget_tokens=64, sink_tokens=4), prompt_of(9, 4), 8)
    for (full, context), (roomy, same) in zip(full_rows, roomy_rows):
        assert context == same
        torch.testing.assert_close(full, roomy, atol=0, rtol=0)


def test_h2o_stays_within_its_budget(kind: str) -> None:
    _, rows, most_blocks = run(kind, KvPolicy("h2o", budget_tokens=16), prompt_of(10, 5), 20)
    assert len(rows) == 20 and most_blocks <= 4


def test_moving_a_key_back_equals_storing_it_at_the_earlier_position(kind: str, reference: torch.nn.Module) -> None:
    from services.worker.engine.kv.kv_rotation import KeyRotation

    class OneLayer:
        keys = [torch.zeros(1)]
        device = torch.device("cpu")

    rotation = KeyRotation(reference.model, OneLayer)   # type: ignore[arg-type]
    types = getattr(reference.config, "layer_types", None) or [None]
    for layer_type in set(types):
        rotation.layer_types = [layer_type]
        width = rotation.cos_sin(layer_type, 0, torch.device("cpu"))[0].shape[0]
        key = torch.randn(3, width)
        at = {p: key * rotation.cos_sin(layer_type, p, torch.device("cpu"))[0]
              + _rotate_half(key) * rotation.cos_sin(layer_type, p, torch.device("cpu"))[1] for p in (37, 21)}
        cos, sin = rotation.cos_sin(layer_type, 16, torch.device("cpu"))
        torch.testing.assert_close(at[37] * cos - _rotate_half(at[37]) * sin, at[21], atol=1e-5, rtol=0)


def test_h2o_scores_are_each_layer_and_head_attention_summed(kind: str) -> None:
    engine = make_engine(kind, block_size=BLOCK)
    new = NewSequence("s", tuple(prompt_of(10, 6)), (), SamplingParams(), kv_policy=KvPolicy("h2o", 64))
    engine.step(StepBatch(new_sequences=[new], work=[WorkItem("s", 1024)]))
    engine.step(StepBatch(work=[WorkItem("s", 1)]))
    config = engine.model_config
    per_step = config.num_hidden_layers * config.num_attention_heads     # each head's weights sum to 1
    scores = engine.sequences.get("s").block_scores
    assert len(scores) == 3 and sum(scores) == pytest.approx(2 * per_step, rel=1e-4)


def test_h2o_drops_the_least_attended_blocks_outside_the_recent_half() -> None:
    from services.worker.engine.kv.kv_policy import BlockBudget, KvEvictor

    class Seq:
        block_scores = [9.0, 1.0, 5.0, 0.5, 7.0, 0.1, 0.2]

    evictor = KvEvictor(None, None, BLOCK)  # type: ignore[arg-type]
    budget = BlockBudget("h2o", blocks=6, sink_blocks=0, recent_blocks=3)
    # candidates 0..6: the last three are recent; of 0..3 the two least attended are 3 and 1
    assert evictor._victims(Seq(), budget, list(range(7)), 2) == [1, 3]
    assert evictor._victims(Seq(), budget, list(range(7)), 5) == [0, 1, 2, 3, 4]
