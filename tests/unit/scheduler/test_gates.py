"""Admission gates on plain values: what rejects at once, what holds, what times out."""

from __future__ import annotations

from services.scheduler.core import gates
from services.scheduler.core.types import Gate, RequestSpec, WorkerSpec

WORKER = WorkerSpec(worker_id="w0", address="w0:1", block_size=4, num_blocks=16, max_model_len=100)


def _spec(prompt: tuple[int, ...] = (5, 6, 7), request_id: str = "r1") -> RequestSpec:
    return RequestSpec(request_id=request_id, prompt_token_ids=prompt, max_tokens=4)


def test_reject_early_checks_in_order_and_passes_a_request_that_can_queue() -> None:
    empty = gates.reject_early(_spec(prompt=()), already_in_flight=True, num_workers=0, num_waiting=9,
                               max_queue_len=1)
    assert empty is not None and empty.gate is Gate.INVALID and "empty" in empty.message
    duplicate = gates.reject_early(_spec(), already_in_flight=True, num_workers=0, num_waiting=9, max_queue_len=1)
    assert duplicate is not None and duplicate.gate is Gate.INVALID and "'r1'" in duplicate.message
    no_worker = gates.reject_early(_spec(), already_in_flight=False, num_workers=0, num_waiting=9, max_queue_len=1)
    assert no_worker is not None and no_worker.gate is Gate.NO_WORKER
    full = gates.reject_early(_spec(), already_in_flight=False, num_workers=2, num_waiting=3, max_queue_len=3)
    assert full is not None and full.gate is Gate.QUEUE
    assert "3 requests waiting" in full.message and "MAX_QUEUE_LEN=3" in full.message
    assert gates.reject_early(_spec(), already_in_flight=False, num_workers=2, num_waiting=2, max_queue_len=3) is None


def test_output_limit_fills_the_context_only_when_max_tokens_is_unset() -> None:
    assert gates.output_limit(7, prompt_len=30, max_model_len=100) == 7
    assert gates.output_limit(0, prompt_len=30, max_model_len=100) == 70
    assert gates.output_limit(-1, prompt_len=30, max_model_len=100) == 70


def test_never_fit_names_the_limit_a_request_exceeds_and_accepts_the_boundaries() -> None:
    assert gates.never_fit(WORKER, prompt_len=30, max_tokens=34, max_active_kv_tokens=64) == ""  # 64 tokens, 16 blocks
    context = gates.never_fit(WORKER, prompt_len=30, max_tokens=71, max_active_kv_tokens=1000)
    assert "101 tokens" in context and "model context of 100" in context
    assert "model context" in gates.never_fit(WORKER, prompt_len=30, max_tokens=0, max_active_kv_tokens=1000)
    pool = gates.never_fit(WORKER, prompt_len=30, max_tokens=35, max_active_kv_tokens=1000)  # 65 tokens: 17 blocks
    assert "17 KV blocks of 4 tokens" in pool and "has 16" in pool
    kv = gates.never_fit(WORKER, prompt_len=30, max_tokens=31, max_active_kv_tokens=60)
    assert "MAX_ACTIVE_KV_TOKENS=60" in kv


def test_the_hold_gates_admit_up_to_the_limit_and_check_active_kv_first() -> None:
    assert gates.fits_active_kv(reserved_kv_tokens=40, kv_reservation=10, max_active_kv_tokens=50)
    assert not gates.fits_active_kv(reserved_kv_tokens=41, kv_reservation=10, max_active_kv_tokens=50)
    assert gates.fits_cache_pool(known_tokens=16, block_size=4, available_blocks=4)
    assert not gates.fits_cache_pool(known_tokens=17, block_size=4, available_blocks=4)
    both = dict(reserved_kv_tokens=45, kv_reservation=10, max_active_kv_tokens=50, known_tokens=17, block_size=4,
                available_blocks=4)
    assert gates.holding_gate(**both) is Gate.ACTIVE_KV
    assert gates.holding_gate(**{**both, "reserved_kv_tokens": 0}) is Gate.CACHE_POOL
    assert gates.holding_gate(**{**both, "reserved_kv_tokens": 0, "available_blocks": 5}) is None


def test_only_a_request_never_admitted_times_out_and_the_message_says_what_held_it() -> None:
    assert gates.timed_out(admitted_once=False, waited_s=5.1, queue_timeout_s=5.0)
    assert not gates.timed_out(admitted_once=False, waited_s=5.0, queue_timeout_s=5.0)
    assert not gates.timed_out(admitted_once=True, waited_s=500.0, queue_timeout_s=5.0)
    message = gates.timeout_message({Gate.CACHE_POOL, Gate.ACTIVE_KV}, waited_s=6.04, queue_timeout_s=5.0)
    assert message == "not admitted after 6.0 s (QUEUE_TIMEOUT_S=5); held by: active_kv, cache_pool"
    assert gates.timeout_message(set(), waited_s=6.0, queue_timeout_s=5.5).endswith(
        "(QUEUE_TIMEOUT_S=5.5); held by: queue order")
