"""The engine under both eviction policies: a shared prompt between floods of
one-off prompts that overflow the pool, with every output equal to transformers'."""

from __future__ import annotations

import pytest
import torch

from tests.unit.worker.engine_helpers import Driver, generate, make_engine, prompt_of

BLOCK_SIZE = 4


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_reused_prompt_through_floods_that_overflow_the_pool(kind: str, reference: torch.nn.Module,
                                                               policy: str) -> None:
    engine = make_engine(kind, num_blocks=24, block_size=BLOCK_SIZE, eviction_policy=policy,
                         prompt_logits_cache_size=0)
    driver = Driver(engine)
    shared = prompt_of(33, 1)               # 8 full blocks and one more token
    cached_per_turn = []
    for turn in range(5):
        driver.run({f"shared{turn}": shared}, 3)
        cached_per_turn.append(driver.cached.get(f"shared{turn}", 0))
        # Two one-off prompts at first (they fit beside it), then four (the pool overflows).
        fillers = {f"filler{turn}-{n}": prompt_of(24, 10 + 7 * turn + n) for n in range(2 if turn < 2 else 4)}
        for seq_id, prompt in fillers.items():
            assert driver.run({seq_id: prompt}, 2) == {seq_id: generate(reference, prompt, 2)}
    assert all(driver.outputs[f"shared{turn}"] == generate(reference, shared, 3) for turn in range(5))
    assert engine.pool_stats().evictions > 0
    if policy == "lfu":
        assert cached_per_turn == [0] + [32] * 4          # reused once before the floods: kept
    else:
        assert cached_per_turn == [0, 32, 32, 0, 0]       # pushed out by each overflowing flood
