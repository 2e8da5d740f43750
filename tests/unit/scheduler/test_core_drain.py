"""A worker leaving on purpose (drain): nothing new goes to it, its requests
move to the others with no gap or repeat, and alone it keeps serving them."""

from __future__ import annotations

import pytest

from services.scheduler.core.types import CoreConfig, FinishReason, Gate

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.harness import Harness

PROMPT = tuple(range(30, 42))


def _two_workers(**config: object) -> Harness:
    return Harness(CoreConfig(**config), {"w0": FakeEngine(), "w1": FakeEngine()})  # type: ignore[arg-type]


@pytest.mark.parametrize("steps_in_flight", [1, 2])
def test_a_draining_worker_hands_its_requests_over_without_a_gap_or_repeat(steps_in_flight: int) -> None:
    h = _two_workers(max_batch_size=1, max_steps_in_flight=steps_in_flight)
    running = h.submit(PROMPT, max_tokens=8, hints={"w1": 12}, session_id="s").request_id
    waiting = h.submit(PROMPT[::-1], max_tokens=3, hints={"w1": 12}).request_id
    for _ in range(3):
        h.step()
    streamed = len(h.streams[running].token_ids)
    assert 0 < streamed < 8 and h.core.worker_of(waiting) == "w1"

    outcome = h.core.drain_worker("w1")
    h.deliver(outcome.updates)
    assert (outcome.known, outcome.started, outcome.moved, outcome.remaining) == (True, True, 2, 0)
    assert outcome.drained and outcome.updates == ()
    assert h.core.worker_of(running) == "w0" and h.core.worker_of(waiting) == "w0"
    h.run()
    assert h.streams[running].token_ids == reference_output(PROMPT, 8)
    assert h.streams[running].finish.reason is FinishReason.LENGTH
    assert h.streams[waiting].token_ids == reference_output(PROMPT[::-1], 3)
    assert h.core.stats().migrations == 1
    # Its session follows it.
    assert h.submit(PROMPT, session_id="s", hints={"w1": 12}).worker_id == "w0"


def test_nothing_new_goes_to_a_draining_worker_and_it_reports_unhealthy() -> None:
    h = _two_workers()
    assert h.core.drain_worker("w1").drained
    for _ in range(3):
        assert h.submit(PROMPT, hints={"w1": 12}).worker_id == "w0"
    healthy = {w.worker_id: w.healthy for w in h.core.stats().workers}
    assert healthy == {"w0": True, "w1": False}
    again = h.core.drain_worker("w1")
    assert again.known and not again.started and again.drained


def test_a_lone_draining_worker_keeps_serving_what_it_holds_and_refuses_new_requests() -> None:
    h = Harness(CoreConfig(max_batch_size=1), FakeEngine())
    running = h.submit(PROMPT, max_tokens=6).request_id
    waiting = h.submit(PROMPT[::-1], max_tokens=3).request_id
    h.step()
    outcome = h.core.drain_worker("w0")
    assert (outcome.moved, outcome.remaining, outcome.drained) == (0, 2, False)
    assert h.submit(PROMPT).rejection.gate is Gate.NO_WORKER
    h.run()
    assert h.streams[running].token_ids == reference_output(PROMPT, 6)
    assert h.streams[waiting].token_ids == reference_output(PROMPT[::-1], 3)
    assert h.core.drain_worker("w0").drained
    h.deliver(h.core.remove_worker("w0", "w0 drained"))
    assert h.core.worker_ids() == []


def test_a_worker_registering_during_a_drain_takes_over_at_the_next_call() -> None:
    h = Harness(CoreConfig(), FakeEngine())
    running = h.submit(PROMPT, max_tokens=8).request_id
    h.step()
    h.step()
    assert h.core.drain_worker("w0").remaining == 1
    newcomer = FakeEngine()
    h.engines["w1"], h.plans["w1"] = newcomer, []
    h.deliver(h.core.add_worker(newcomer.spec("w1")))
    assert h.core.worker_of(running) == "w0"     # until the draining worker asks again
    outcome = h.core.drain_worker("w0")
    assert (outcome.moved, outcome.remaining) == (1, 0)
    h.run()
    assert h.streams[running].token_ids == reference_output(PROMPT, 8)


def test_a_draining_worker_that_registers_again_serves_again() -> None:
    h = _two_workers()
    h.core.drain_worker("w1")
    restarted = FakeEngine()
    h.engines["w1"] = restarted
    h.core.add_worker(restarted.spec("w1"))
    assert h.submit(PROMPT, hints={"w1": 12}).worker_id == "w1"


def test_draining_an_unknown_worker_hands_nothing_over() -> None:
    h = _two_workers()
    outcome = h.core.drain_worker("nobody")
    assert (outcome.known, outcome.drained, outcome.moved, outcome.remaining) == (False, False, 0, 0)
