"""Every gate's outcome: reject at once, soft hold, and timeout."""

from __future__ import annotations

from services.scheduler.core.types import CoreConfig, FinishReason, Gate

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.harness import Harness

PROMPT = tuple(range(20, 36))  # 16 tokens


def test_queue_gate_rejects_past_max_queue_len() -> None:
    h = Harness(CoreConfig(max_queue_len=2), FakeEngine())
    assert h.submit(PROMPT).accepted and h.submit(PROMPT).accepted
    third = h.submit(PROMPT)
    assert third.rejection is not None and third.rejection.gate is Gate.QUEUE
    assert "MAX_QUEUE_LEN=2" in third.rejection.message
    h.step()  # both admitted: the queue has room again
    assert h.submit(PROMPT).accepted
    assert h.core.stats().rejections == {"queue": 1}


def test_never_fit_is_refused_with_the_numbers() -> None:
    h = Harness(CoreConfig(max_active_kv_tokens=200), FakeEngine(num_blocks=16, block_size=4,
                                                                  max_model_len=100))
    too_long = h.submit(PROMPT, max_tokens=90).rejection
    assert too_long is not None and too_long.gate is Gate.NEVER_FIT
    assert "16 tokens" in too_long.message and "90" in too_long.message and "100" in too_long.message
    too_big_for_pool = h.submit(PROMPT, max_tokens=60).rejection  # 76 tokens = 19 blocks > 16
    assert too_big_for_pool is not None and too_big_for_pool.gate is Gate.NEVER_FIT
    assert "19 KV blocks" in too_big_for_pool.message and "16" in too_big_for_pool.message
    assert h.core.stats().rejections == {"never_fit": 2}

    tight = Harness(CoreConfig(max_active_kv_tokens=30), FakeEngine())
    over_kv = tight.submit(PROMPT, max_tokens=20).rejection
    assert over_kv is not None and over_kv.gate is Gate.NEVER_FIT and "MAX_ACTIVE_KV_TOKENS=30" in over_kv.message


def test_active_kv_gate_holds_until_reservations_are_released() -> None:
    h = Harness(CoreConfig(max_active_kv_tokens=50), FakeEngine())
    first = h.submit(PROMPT, max_tokens=10).request_id   # reserves 26
    second = h.submit(PROMPT, max_tokens=10).request_id  # 26 + 26 > 50: held
    h.step()
    stats = h.core.stats()
    assert stats.holds == {"active_kv": 1}
    assert (stats.pending, stats.prefilling + stats.active, stats.reserved_kv_tokens) == (1, 1, 26)
    h.run()
    assert h.streams[second].first_token_step > h.streams[first].finish_step
    assert h.streams[second].finish.reason is FinishReason.LENGTH
    assert h.core.stats().holds == {"active_kv": 1}  # counted once per request and gate


def test_cache_pool_gate_holds_while_the_pool_cannot_take_the_prompt() -> None:
    engine = FakeEngine(num_blocks=8, block_size=4, prefix_caching=False)
    h = Harness(CoreConfig(), engine)
    first = h.submit(PROMPT, max_tokens=8).request_id  # 4 prompt blocks, up to 6
    h.step()
    second = h.submit(tuple(range(100, 116)), max_tokens=8).request_id  # needs 4 of the 4 left...
    h.step()
    h.step()  # ...but the first one has grown into a 5th block by now
    assert h.core.stats().holds.get("cache_pool") == 1
    assert h.streams[second].first_token_step is None
    h.run()
    assert h.streams[first].token_ids == reference_output(PROMPT, 8)
    assert h.streams[second].token_ids == reference_output(tuple(range(100, 116)), 8)
    assert engine.pool().used_blocks == 0


def test_a_held_request_past_the_queue_timeout_is_unavailable() -> None:
    h = Harness(CoreConfig(max_active_kv_tokens=50, queue_timeout_s=5.0), FakeEngine(), step_s=1.0)
    running = h.submit(PROMPT, max_tokens=30).request_id  # 46 reserved for ~30 s
    held = h.submit(PROMPT, max_tokens=10).request_id
    for _ in range(5):
        h.step()
    assert not h.core.expire().updates
    h.step()
    expired = h.core.expire()
    h.deliver(expired.updates)
    rejection = h.streams[held].rejection
    assert rejection is not None and rejection.gate is Gate.TIMEOUT
    assert "QUEUE_TIMEOUT_S=5" in rejection.message and "active_kv" in rejection.message
    assert h.core.stats().rejections == {"timeout": 1}
    h.run()
    assert h.streams[running].finish.reason is FinishReason.LENGTH
