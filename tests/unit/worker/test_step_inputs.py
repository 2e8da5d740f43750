"""A step's packed inputs on a tiny case: token ids, positions, slot mapping, the decodes'
block tables, the prefill chunks and the rows that sample."""

from __future__ import annotations

import torch

from common.types import SamplingParams
from services.worker.engine.kv.block_pool import BlockPool
from services.worker.engine.kv.kv_cache import LayerKVSpec, PagedKVCache
from services.worker.engine.step.planning import Planned
from services.worker.engine.sampling.sampler import SampleRequest
from services.worker.engine.step.sequences import SequenceState
from services.worker.engine.step.step_inputs import build_step_inputs, slot

BLOCK = 4
CPU = torch.device("cpu")


def sequence(pool: BlockPool, seq_id: str, tokens: list[int], allocate: int) -> SequenceState:
    assert pool.allocate(seq_id, allocate)
    request = SampleRequest(params=SamplingParams(), prompt_token_ids=list(tokens), output_token_ids=[], num_sampled=0)
    return SequenceState(seq_id, list(tokens), request)


def build(order: list[Planned], pool: BlockPool):
    kv = PagedKVCache([LayerKVSpec(num_kv_heads=1, head_dim=2)], pool.num_blocks, BLOCK, torch.float32, CPU)
    return build_step_inputs(order, pool, kv, [0], CPU)


def test_slot_is_the_block_of_the_position_then_its_offset() -> None:
    assert slot([7, 3], 0, BLOCK) == 28
    assert slot([7, 3], 5, BLOCK) == 13


def test_a_decode_then_a_prefill_chunk() -> None:
    pool = BlockPool(8, BLOCK, enable_prefix_caching=False)
    decode = Planned(sequence(pool, "d", [10, 11, 12, 13, 14, 15], 6), start=5, num_tokens=1, cached_tokens=0,
                     result_index=0)
    prefill = Planned(sequence(pool, "p", [20, 21, 22, 23, 24, 25, 26], 7), start=0, num_tokens=7,
                      cached_tokens=0, result_index=1)
    d_table, p_table = pool.table("d"), pool.table("p")
    inputs = build([decode, prefill], pool)

    assert inputs.input_ids.tolist() == [15, 20, 21, 22, 23, 24, 25, 26]
    assert inputs.positions.tolist() == [5, 0, 1, 2, 3, 4, 5, 6]
    prefill_slots = [slot(p_table, position, BLOCK) for position in range(7)]
    assert inputs.meta.slot_mapping.tolist() == [d_table[1] * BLOCK + 1, *prefill_slots]
    assert inputs.meta.num_decodes == 1 and inputs.meta.num_tokens == 8
    assert inputs.meta.decode_ctx_lens.tolist() == [6]
    assert inputs.meta.decode_block_tables.tolist() == [d_table]
    assert inputs.meta.decode_ctx_range == (6, 6)
    [chunk] = inputs.meta.prefills
    assert (chunk.row_start, chunk.num_tokens, chunk.start_pos) == (1, 7, 0)
    assert chunk.context_slots.tolist() == prefill_slots
    assert inputs.sample_rows == [0, 7] and inputs.sample_plans == [decode, prefill]


def test_a_continued_chunk_reads_its_whole_context_and_drafts_sample_every_row() -> None:
    pool = BlockPool(8, BLOCK, enable_prefix_caching=False)
    tokens = [30, 31, 32, 33, 34, 35]
    # The last token decoded with two drafts: rows at positions 5, 6, 7.
    chunk = Planned(sequence(pool, "s", tokens, 8), start=5, num_tokens=1, cached_tokens=0, result_index=0,
                    drafts=[36, 37])
    table = pool.table("s")
    inputs = build([chunk], pool)

    assert inputs.input_ids.tolist() == [35, 36, 37]
    assert inputs.positions.tolist() == [5, 6, 7]
    assert inputs.meta.num_decodes == 0 and inputs.meta.decode_block_tables.shape == (0, 0)
    assert inputs.meta.slot_mapping.tolist() == [slot(table, position, BLOCK) for position in (5, 6, 7)]
    [prefill] = inputs.meta.prefills
    assert (prefill.row_start, prefill.num_tokens, prefill.start_pos) == (0, 3, 5)
    assert prefill.context_slots.tolist() == [slot(table, position, BLOCK) for position in range(8)]
    assert inputs.sample_rows == [0, 1, 2] and inputs.sample_plans == [chunk] * 3


def test_a_chunk_that_does_not_reach_the_end_samples_nothing() -> None:
    pool = BlockPool(8, BLOCK, enable_prefix_caching=False)
    part = Planned(sequence(pool, "s", list(range(40, 50)), 4), start=0, num_tokens=4, cached_tokens=0,
                   result_index=0)
    inputs = build([part], pool)
    assert inputs.input_ids.tolist() == [40, 41, 42, 43]
    assert inputs.sample_rows == [] and inputs.sample_plans == []
