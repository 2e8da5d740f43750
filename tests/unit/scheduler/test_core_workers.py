"""Several workers: routing, session stickiness, workers leaving, stats."""

from __future__ import annotations

from services.scheduler.core.types import CoreConfig, FinishReason, Gate

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.harness import Harness

PROMPT = tuple(range(30, 42))


def _two_workers(**config: object) -> Harness:
    return Harness(CoreConfig(**config), {"w0": FakeEngine(), "w1": FakeEngine()})  # type: ignore[arg-type]


def test_routes_to_the_longest_cached_prefix_then_the_least_loaded() -> None:
    h = _two_workers()
    assert h.submit(PROMPT, hints={"w1": 8, "w0": 4}).worker_id == "w1"
    assert h.submit(PROMPT, hints={}).worker_id == "w0"  # tie at 0: w0 has less load
    assert h.submit(PROMPT, hints={"w0": 0, "w1": 0}).worker_id in {"w0", "w1"}
    loads = [h.submit(PROMPT).worker_id for _ in range(4)]
    assert sorted(loads) == ["w0", "w0", "w1", "w1"]


def test_a_session_sticks_to_its_worker() -> None:
    h = _two_workers()
    first = h.submit(PROMPT, session_id="s1", hints={"w1": 12}).worker_id
    assert first == "w1"
    for _ in range(3):
        assert h.submit(PROMPT, session_id="s1", hints={"w0": 12}).worker_id == "w1"
    assert h.submit(PROMPT, session_id="s2", hints={"w0": 12}).worker_id == "w0"


def test_a_silent_workers_requests_move_to_the_worker_left_and_lose_nothing() -> None:
    h = _two_workers(max_batch_size=1, heartbeat_timeout_s=5.0)
    running = h.submit(PROMPT, max_tokens=6, hints={"w1": 12}, session_id="s").request_id
    waiting = h.submit(PROMPT[::-1], max_tokens=3, hints={"w1": 12}).request_id
    h.step()
    h.step()
    assert len(h.streams[running].token_ids) == 2
    assert h.core.worker_of(waiting) == "w1"
    h.engines.pop("w1")  # it stops stepping and heartbeating
    h.clock.advance(4.0)
    assert h.core.heartbeat("w0")
    assert not h.core.expire().removed_workers
    h.clock.advance(2.0)
    assert h.core.heartbeat("w0")
    outcome = h.core.expire()
    assert outcome.removed_workers == ("w1",)
    h.deliver(outcome.updates)
    assert h.streams[running].finish is None
    # The running request resumes on w0 from the two tokens it streamed; the one that
    # had not started yet simply moves.
    assert h.core.worker_of(running) == "w0" and h.core.worker_of(waiting) == "w0"
    h.run()
    assert h.streams[running].token_ids == reference_output(PROMPT, 6)
    assert h.streams[running].finish.reason is FinishReason.LENGTH
    assert h.streams[waiting].token_ids == reference_output(PROMPT[::-1], 3)
    stats = h.core.stats()
    assert [w.worker_id for w in stats.workers] == ["w0"] and stats.migrations == 1
    # Its session follows it.
    assert h.submit(PROMPT, session_id="s", hints={}).worker_id == "w0"


def test_when_the_last_worker_leaves_waiting_requests_are_unavailable() -> None:
    h = Harness(CoreConfig(max_batch_size=1, worker_recovery_s=0), FakeEngine())   # recovery off
    running = h.submit(PROMPT, max_tokens=10).request_id
    waiting = h.submit(PROMPT, max_tokens=10).request_id
    h.step()
    h.deliver(h.core.remove_worker("w0", "Step failed: connection refused"))
    assert h.streams[running].finish.reason is FinishReason.ERROR
    assert h.streams[running].finish.message == "Step failed: connection refused; no worker is left to resume it"
    assert h.streams[waiting].rejection is not None
    assert h.streams[waiting].rejection.gate is Gate.NO_WORKER
    assert h.submit(PROMPT).rejection.gate is Gate.NO_WORKER


def test_a_worker_error_on_one_sequence_ends_only_that_request() -> None:
    h = Harness(CoreConfig(), FakeEngine())
    a = h.submit(PROMPT, max_tokens=5).request_id
    b = h.submit(PROMPT[::-1], max_tokens=5).request_id
    h.step()
    engine = h.engines["w0"]
    victim_seq = next(s for s, seq in engine.seqs.items() if seq.tokens[0] == PROMPT[0])
    engine._free(victim_seq)  # the worker lost it: its next work item is an "unknown_sequence"
    h.step()
    assert h.streams[a].finish.reason is FinishReason.ERROR
    assert "unknown_sequence" in h.streams[a].finish.message
    assert h.streams[b].finish is None


def test_a_worker_registering_again_resumes_its_running_requests_and_keeps_the_waiting() -> None:
    h = Harness(CoreConfig(max_batch_size=1), FakeEngine())
    running = h.submit(PROMPT, max_tokens=10).request_id
    waiting = h.submit(PROMPT[::-1], max_tokens=3).request_id
    h.step()
    fresh = FakeEngine()
    h.engines["w0"] = fresh
    h.deliver(h.core.add_worker(fresh.spec("w0")))
    assert h.streams[running].finish is None
    h.run()
    assert h.streams[running].token_ids == reference_output(PROMPT, 10)
    assert h.streams[waiting].token_ids == reference_output(PROMPT[::-1], 3)
    assert h.core.stats().migrations == 1


def test_a_running_request_that_cannot_fit_the_worker_left_ends_with_an_error() -> None:
    h = Harness(CoreConfig(max_batch_size=1), {"w0": FakeEngine(), "w1": FakeEngine(max_model_len=16)})
    running = h.submit(PROMPT, max_tokens=10, hints={"w0": 12}).request_id
    h.step()
    h.engines.pop("w0")
    h.deliver(h.core.remove_worker("w0", "w0 crashed"))
    finish = h.streams[running].finish
    assert finish is not None and finish.reason is FinishReason.ERROR
    assert finish.message.startswith("w0 crashed; ") and "16" in finish.message
    assert h.core.stats().migrations == 0


def test_stats_report_queues_counters_and_workers() -> None:
    h = _two_workers(max_batch_size=1, max_queue_len=3)
    for client in ("a", "a", "b"):
        h.submit(PROMPT, max_tokens=2, client_id=client)
    h.submit(PROMPT, max_tokens=2)  # rejected: 3 waiting
    h.step()
    stats = h.core.stats()
    assert (stats.pending, stats.prefilling + stats.active, stats.admitted) == (1, 2, 2)
    assert stats.rejections == {"queue": 1}
    assert stats.policy.value == "auto"   # the default: fcfs until a request carries a tenant
    assert stats.reserved_kv_tokens == 2 * (len(PROMPT) + 2)
    assert {c.client_id for c in stats.clients} == {"a", "b"}
    assert all(w.steps == 1 and w.last_batch_size == 1 and w.healthy for w in stats.workers)
    h.run()
    stats = h.core.stats()
    assert stats.finished == 3 and stats.finished_by_reason == {"length": 3}
    served = {c.client_id: c.served_tokens for c in stats.clients}
    assert served == {"a": 2 * (len(PROMPT) + 2), "b": len(PROMPT) + 2}


def test_cold_prompts_one_at_a_time_spread_over_idle_workers() -> None:
    h = _two_workers()
    used = []
    for index in range(4):
        result = h.submit(tuple(range(100 * index, 100 * index + 12)), max_tokens=4)
        used.append(result.worker_id)
        h.run()  # both workers idle again before the next prompt
    # The worker that served last has fewer never-used blocks: the next cold prompt goes to the other.
    assert used == ["w0", "w1", "w0", "w1"]


def test_a_preempted_request_waiting_on_a_failed_worker_resumes_elsewhere() -> None:
    h = _two_workers(max_batch_size=1)
    low = h.submit(PROMPT, max_tokens=6, hints={"w0": 12}).request_id
    h.step()
    h.step()
    high = h.submit(PROMPT[::-1], max_tokens=2, priority=1, hints={"w0": 12}).request_id
    h.step()        # high takes low's slot: low waits on w0 with two tokens streamed
    assert len(h.streams[low].token_ids) == 2 and h.core.worker_of(low) == "w0"
    h.engines.pop("w0")
    h.deliver(h.core.remove_worker("w0", "w0 crashed"))
    assert h.core.worker_of(low) == h.core.worker_of(high) == "w1"
    h.run()
    assert h.streams[low].token_ids == reference_output(PROMPT, 6)
    assert h.streams[high].token_ids == reference_output(PROMPT[::-1], 2)
    assert h.core.stats().migrations == 2


def test_a_preempted_request_ends_with_an_error_when_no_worker_is_left() -> None:
    h = Harness(CoreConfig(max_batch_size=1, worker_recovery_s=0), FakeEngine())   # recovery off
    low = h.submit(PROMPT, max_tokens=6).request_id
    h.step()
    h.step()
    high = h.submit(PROMPT[::-1], max_tokens=6, priority=1).request_id
    h.step()
    h.deliver(h.core.remove_worker("w0", "w0 crashed"))
    for request_id in (low, high):      # both have streamed tokens: an error, not a rejection
        finish = h.streams[request_id].finish
        assert finish is not None and finish.reason is FinishReason.ERROR
        assert finish.message == "w0 crashed; no worker is left to resume it"
    assert not h.core._waiting_by_client      # test-only peek: nothing left counted as waiting
