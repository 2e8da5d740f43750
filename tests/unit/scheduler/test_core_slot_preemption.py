"""A full batch gives a slot to a higher priority, and under vtc to a client
holding less than its fair share; the preempted request resumes unchanged."""

from __future__ import annotations

from services.scheduler.core.types import CoreConfig, Policy

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.harness import Harness

BATCH = 4


def _fill(h: Harness, client: str, count: int, max_tokens: int = 40) -> list[str]:
    ids = [h.submit(tuple(range(10 * i, 10 * i + 12)), max_tokens=max_tokens, client_id=client).request_id
           for i in range(count)]
    for _ in range(3):
        h.step()
    return ids


def _reference(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    h = Harness(CoreConfig(), FakeEngine(num_blocks=1024))
    rid = h.submit(prompt, max_tokens=max_tokens).request_id
    h.run()
    return h.streams[rid].token_ids


def test_higher_priority_takes_a_slot_at_once_and_the_victim_resumes_intact() -> None:
    h = Harness(CoreConfig(policy=Policy.FCFS, max_batch_size=BATCH), FakeEngine(num_blocks=1024))
    heavy = _fill(h, "heavy", BATCH)
    urgent = h.submit(tuple(range(500, 512)), max_tokens=4, client_id="other", priority=5).request_id
    h.step()
    assert h.streams[urgent].first_token_step == h.steps - 1
    assert h.core.stats().preemptions == 1
    h.run()
    for i, rid in enumerate(heavy):
        assert h.streams[rid].token_ids == _reference(tuple(range(10 * i, 10 * i + 12)), 40)


def test_vtc_gives_an_under_share_client_a_slot_and_fcfs_does_not() -> None:
    for policy, expect_wait_at_most in ((Policy.VTC, 1), (Policy.FCFS, 30)):
        h = Harness(CoreConfig(policy=policy, max_batch_size=BATCH), FakeEngine(num_blocks=1024))
        _fill(h, "heavy", 3 * BATCH)
        sent = h.steps
        light = h.submit(tuple(range(700, 712)), max_tokens=4, client_id="light").request_id
        h.run()
        waited = h.streams[light].first_token_step - sent
        if policy is Policy.VTC:
            assert waited <= expect_wait_at_most
        else:
            assert waited > 1 and h.core.stats().preemptions == 0


def test_fair_share_preemption_does_not_ping_pong() -> None:
    h = Harness(CoreConfig(policy=Policy.VTC, max_batch_size=BATCH), FakeEngine(num_blocks=1024))
    _fill(h, "a", 2 * BATCH)
    _fill(h, "b", 2 * BATCH)
    h.run()
    # Each client may push the other back to its share once per admission at
    # most; nothing near one preemption per step.
    assert h.core.stats().preemptions <= 2 * BATCH
    assert all(s.finish is not None for s in h.streams.values())
