"""The parity tests of test_engine_parity.py on Gemma 4 text shapes: per-layer
embeddings, KV-shared layers that read an earlier layer's paged cache, wider
heads and proportional RoPE on global layers, final logit softcapping; once
with separate values and once with keys as values (attention_k_eq_v). The
exact-match tests too: a copied tail must carry every storing layer's K/V."""

from __future__ import annotations

import pytest

from tests.unit.worker.test_engine_parity import (  # noqa: F401  (collected here with the fixture below)
    test_block_events_and_snapshot,
    test_chunks_on_block_boundaries_and_single_token_chunks,
    test_mixed_batch_with_chunked_prefill_matches_generate,
    test_out_of_blocks_changes_nothing_and_recovers,
    test_resume_with_output_tokens_continues_the_same_text,
    test_running_sequences_share_blocks_and_block_aligned_prompt_copies_its_last_block,
    test_seeded_sampling_does_not_depend_on_the_batch,
    test_shared_prefix_blocks_are_reused,
)
from tests.unit.worker.test_engine_exact_match import (  # noqa: F401
    test_identical_prompt_computes_only_its_last_token,
    test_prompt_made_of_an_earlier_prompt_and_its_output_reuses_the_tail,
)
from tests.unit.worker.engine_helpers import make_engine


@pytest.fixture(scope="module", params=["gemma4", "gemma4_k_eq_v"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def test_shared_layers_own_no_cache_and_read_their_source(kind: str) -> None:
    engine = make_engine(kind)
    # Layers 3-5 reuse KV: sliding layers read layer 1 (the last storing sliding layer), global ones layer 2.
    assert engine.forward.cache_layer == [0, 1, 2, 1, 1, 2]
    assert [k is None for k in engine.kv.keys] == [False, False, False, True, True, True]
    assert engine.kv.keys[2].shape[-1] == 32 and engine.kv.keys[0].shape[-1] == 16
