"""The hybrid KV layout (sliding_blocks.py) on tiny models whose layers mix full attention
and a sliding window of 8 tokens: with a sliding group far smaller than the pool, long
sequences give the same greedy tokens as transformers and as one cache for every layer,
hold the sliding layers' K/V for about one window, and reuse a cached prefix only where
its window is still held."""

from __future__ import annotations

import pytest

from common.step import KvPolicy, NewSequence, StepBatch, WorkItem
from common.types import SamplingParams
from services.worker.engine.cuda import decode_graphs
from services.worker.engine.kv.kv_cache import SLIDING_GROUP
from tests.unit.worker.engine_helpers import (Driver, RecordingSampler, assert_greedy_matches, make_engine,
                                               prompt_of, reference_model)
from tests.unit.worker.test_engine_decode_graphs import graph_engine

BLOCK = 4


def prompts() -> dict[str, list[int]]:
    return {"a": prompt_of(37, 1), "b": prompt_of(52, 2), "c": prompt_of(23, 3)}


def test_the_sliding_layers_get_their_own_smaller_cache() -> None:
    engine = make_engine("gemma3", num_blocks=64, block_size=BLOCK, sliding_blocks=12)
    for layer, keys in enumerate(engine.kv.keys):
        sliding = engine.kv.group[layer] == SLIDING_GROUP
        assert sliding == (layer != 3)          # gemma3's tiny config: three sliding layers, then a full one
        assert keys.shape[0] == (12 if sliding else 64) * BLOCK
    assert engine.kv_layout.window == 8
    assert make_engine("llama", num_blocks=64).sliding is None      # no sliding layer: one group


def test_a_sliding_group_smaller_than_the_pool_is_rejected_below_one_window() -> None:
    with pytest.raises(ValueError, match="KV_CACHE_SLIDING_BLOCKS must be at least 4"):
        make_engine("gemma3", num_blocks=64, block_size=BLOCK, sliding_blocks=3)


@pytest.mark.parametrize("kind", ["gemma3", "qwen2_sliding", "gemma4"])
def test_long_sequences_match_transformers_with_a_window_sized_sliding_group(kind: str) -> None:
    engine = make_engine(kind, num_blocks=128, block_size=BLOCK, sliding_blocks=20)
    driver = Driver(engine)
    got = driver.run(prompts(), 30, chunk={"a": 5, "b": 16, "c": 1024})
    assert_greedy_matches(reference_model(kind), prompts(), got, 30)
    flat = make_engine(kind, num_blocks=128, block_size=BLOCK, kv_hybrid=False)
    assert Driver(flat).run(prompts(), 30, chunk={"a": 5, "b": 16, "c": 1024}) == got


def test_a_chunk_longer_than_the_sliding_group_is_cut_to_fit() -> None:
    engine = make_engine("gemma3", num_blocks=128, block_size=BLOCK, sliding_blocks=4)
    prompt = {"long": prompt_of(90, 4)}
    got = Driver(engine).run(prompt, 20)
    assert_greedy_matches(reference_model("gemma3"), prompt, got, 20)


def test_a_long_sequence_holds_the_sliding_layers_kv_for_about_one_window() -> None:
    engine = make_engine("gemma3", num_blocks=128, block_size=BLOCK, sliding_blocks=8)
    driver = Driver(engine)
    driver.run({"s": prompt_of(150, 5)}, 40, free_at_end=False)
    table = engine.pool.table("s")
    pinned = engine.sliding._pinned_by["s"]
    assert len(table) == 48 and len(pinned) <= 8 // BLOCK + 1
    # Bytes per token: 1 full layer for every block, 3 sliding layers for the window's only.
    per_layer_block = engine.kv.keys[3][:BLOCK].nbytes * 2
    hybrid = per_layer_block * (len(table) + 3 * len(pinned))
    assert hybrid <= per_layer_block * 4 * len(table) / 3


def test_a_cached_prefix_is_reused_only_where_its_window_is_still_held() -> None:
    engine = make_engine("gemma3", num_blocks=128, block_size=BLOCK, sliding_blocks=6)
    driver = Driver(engine)
    shared = prompt_of(40, 6)
    driver.run({"first": shared + [11]}, 4)
    driver.run({"again": shared + [12]}, 4)
    assert driver.cached["again"] == 40          # its last window is still in the sliding group
    driver.run({"other": prompt_of(60, 7)}, 4)   # reclaims those sliding blocks
    got = driver.run({"late": shared + [13]}, 4)
    assert driver.cached.get("late", 0) < 40
    assert_greedy_matches(reference_model("gemma3"), {"late": shared + [13]}, got, 4)


def test_speculative_drafts_and_exact_matches_work_with_the_sliding_group() -> None:
    engine = make_engine("gemma3", num_blocks=128, block_size=BLOCK, sliding_blocks=10)
    driver = Driver(engine)
    repeating = {"r": [2] + [20, 21, 22, 23, 24, 25] * 6}
    got = driver.run(repeating, 24, draft_tokens=3)
    assert_greedy_matches(reference_model("gemma3"), repeating, got, 24)
    assert driver.run({"same": repeating["r"]}, 6) == {"same": got["r"][:6]}


@pytest.mark.parametrize("policy", [KvPolicy("sink", budget_tokens=24, sink_tokens=4),
                                    KvPolicy("h2o", budget_tokens=24)])
def test_lossy_policies_give_the_same_logits_with_the_sliding_group(policy: KvPolicy) -> None:
    rows = {}
    for hybrid in (True, False):
        engine = make_engine("gemma3", num_blocks=64, block_size=BLOCK, sliding_blocks=6, kv_hybrid=hybrid)
        recorder = RecordingSampler(engine.sampler)
        engine.sampler = recorder
        new = [NewSequence("s", tuple(prompt_of(30, 8)), (), SamplingParams(), kv_policy=policy)]
        for _ in range(50):
            out = engine.step(StepBatch(new_sequences=new, work=[WorkItem("s", 7)]))
            new = []
            engine.check_invariants()
            assert not out.results[0].error
        rows[hybrid] = recorder.rows
    assert len(rows[True]) == len(rows[False]) > 20
    for (hybrid_logits, seen), (flat_logits, flat_seen) in zip(rows[True], rows[False]):
        assert seen == flat_seen
        assert (hybrid_logits - flat_logits).abs().max() < 1e-4


def test_decode_graphs_read_the_sliding_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_graphs, "MIN_CONTEXT_BUCKET", 8)    # tiny contexts cross several buckets
    engine = graph_engine("gemma3", sliding_blocks=40)
    got = Driver(engine).run(prompts(), 24)
    assert engine.graphs is not None and engine.graphs.replays > 0 and engine.graphs.enabled
    assert_greedy_matches(reference_model("gemma3"), prompts(), got, 24)


def test_pool_stats_offer_no_more_blocks_than_the_sliding_group_can_attach() -> None:
    engine = make_engine("gemma3", num_blocks=64, block_size=BLOCK, sliding_blocks=10)
    assert engine.pool_stats().available_blocks == 10          # an empty engine: the sliding group binds
    driver = Driver(engine)
    driver.run({"s": prompt_of(20, 9)}, 4, free_at_end=False)  # 6 blocks, all in or near its window
    stats = engine.pool_stats()
    assert stats.available_blocks == engine.sliding.num_available() < 10
    assert stats.used_blocks == 6 and stats.total_blocks == 64
    flat = make_engine("gemma3", num_blocks=64, block_size=BLOCK, kv_hybrid=False)
    assert flat.pool_stats().available_blocks == 64


def test_a_failed_step_leaves_the_window_pinned() -> None:
    """A lossy sequence's failed step is rolled back (drop_journal.py): its table is put back
    in place, so its window keeps its sliding blocks and no other sequence can take them."""
    from tests.unit.worker.test_engine_kv_policy_failure import Injected, fail_next_forward

    engine = make_engine("gemma3", num_blocks=64, block_size=BLOCK, sliding_blocks=8)
    policy = KvPolicy("sink", budget_tokens=16, sink_tokens=4)
    new = [NewSequence("s", tuple(prompt_of(10, 10)), (), SamplingParams(), kv_policy=policy)]
    engine.step(StepBatch(new_sequences=new, work=[WorkItem("s", 1024)]))
    while engine.sequences.get("s").cache_len < 16:
        engine.step(StepBatch(work=[WorkItem("s", 1)]))
    pinned = engine.sliding.pinned("s")
    fail_next_forward(engine)
    with pytest.raises(Injected):
        engine.step(StepBatch(work=[WorkItem("s", 1)]))
    engine.check_invariants()
    assert engine.sliding.pinned("s") == pinned
    out = engine.step(StepBatch(work=[WorkItem("s", 1)]))
    assert not out.results[0].error and out.results[0].sampled
