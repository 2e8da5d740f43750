"""A lone worker's death: what it ran and what waited waits for a worker to
register (WORKER_RECOVERY_S), then resumes exactly as failover does; new
requests queue within the gates meanwhile; past the deadline, an error naming
the setting (core/recovery.py)."""

from __future__ import annotations

from services.scheduler.core.types import CoreConfig, FinishReason, Gate, RequestSpec, TenantQuota

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.harness import Harness

PROMPT = tuple(range(30, 42))
OTHER = tuple(range(60, 75))


def _lone(**config: object) -> Harness:
    return Harness(CoreConfig(**{"max_batch_size": 1, "worker_recovery_s": 60.0, **config}),  # type: ignore[arg-type]
                   FakeEngine())


def _kill(h: Harness, worker_id: str = "w0") -> None:
    """The transport saw the worker fail a step: its calls in flight are gone."""
    h.engines.pop(worker_id)
    h.sent[worker_id] = []
    h.deliver(h.core.remove_worker(worker_id, f"worker {worker_id} failed a step: UNAVAILABLE"))


def _restart(h: Harness, worker_id: str = "w0") -> None:
    h.engines[worker_id] = FakeEngine()
    h.sent[worker_id] = []
    h.deliver(h.core.add_worker(h.engines[worker_id].spec(worker_id)))


def _solo(prompt: tuple[int, ...], max_tokens: int) -> tuple[list[int], int, int]:
    """(tokens, prompt_tokens, completion_tokens) of an undisturbed run."""
    h = _lone()
    rid = h.submit(prompt, max_tokens=max_tokens).request_id
    h.run()
    usage = h.streams[rid].finish.usage
    return h.streams[rid].token_ids, usage.prompt_tokens, usage.completion_tokens


def test_running_and_waiting_requests_wait_for_the_worker_and_resume_identical_to_solo_runs() -> None:
    h = _lone()
    running = h.submit(PROMPT, max_tokens=12).request_id
    waiting = h.submit(OTHER, max_tokens=6).request_id
    for _ in range(4):
        h.step()
    assert 0 < len(h.streams[running].tokens) < 12
    _kill(h)
    h.clock.advance(30.0)
    h.deliver(h.core.expire().updates)
    assert not h.streams[running].done and not h.streams[waiting].done
    assert h.core.stats().waiting_for_worker == 2
    _restart(h)
    h.run()
    for rid, prompt, max_tokens in ((running, PROMPT, 12), (waiting, OTHER, 6)):
        stream = h.streams[rid]
        tokens, prompt_tokens, completion_tokens = _solo(prompt, max_tokens)
        assert stream.finish is not None and stream.finish.reason is FinishReason.LENGTH
        assert stream.token_ids == tokens == reference_output(prompt, max_tokens)
        assert (stream.finish.usage.prompt_tokens, stream.finish.usage.completion_tokens) == \
            (prompt_tokens, completion_tokens)
    assert h.core.stats().migrations == 1       # the running one was resumed by recompute
    assert not h.core._requests and not h.core._waiting_by_client   # test-only peek: all ended


def test_new_requests_queue_while_no_worker_serves_and_run_once_one_registers() -> None:
    h = _lone(max_queue_len=3)
    h.submit(PROMPT, max_tokens=2)
    h.run()
    _kill(h)
    accepted = [h.submit(PROMPT, max_tokens=4, request_id=f"new{i}") for i in range(3)]
    assert all(r.accepted for r in accepted)
    again = h.core.submit(RequestSpec(request_id="new0", prompt_token_ids=PROMPT, max_tokens=4))
    assert again.rejection is not None and again.rejection.gate is Gate.INVALID   # already in flight
    full = h.submit(PROMPT, max_tokens=4)
    assert full.rejection is not None and full.rejection.gate is Gate.QUEUE
    _restart(h)
    h.run()
    for result in accepted:
        assert h.streams[result.request_id].token_ids == reference_output(PROMPT, 4)


def test_a_parked_request_gets_the_worker_checks_when_one_registers() -> None:
    h = _lone()
    _kill(h)
    too_long = h.submit(PROMPT, max_tokens=10_000).request_id   # nothing knows the context yet
    assert not h.streams[too_long].done
    _restart(h)
    rejection = h.streams[too_long].rejection
    assert rejection is not None and rejection.gate is Gate.NEVER_FIT


def test_past_the_deadline_each_request_ends_with_an_error_naming_the_setting() -> None:
    h = _lone(worker_recovery_s=20.0)
    running = h.submit(PROMPT, max_tokens=12).request_id
    waiting = h.submit(OTHER, max_tokens=6).request_id
    h.step()
    h.step()
    _kill(h)
    parked = h.submit(PROMPT, max_tokens=4).request_id
    h.clock.advance(20.5)
    h.deliver(h.core.expire().updates)
    finish = h.streams[running].finish
    assert finish is not None and finish.reason is FinishReason.ERROR
    assert finish.message == ("worker w0 failed a step: UNAVAILABLE; no worker registered within "
                              "WORKER_RECOVERY_S=20 s to serve it")
    assert finish.usage.completion_tokens == len(h.streams[running].tokens) > 0
    for rid in (waiting, parked):
        rejection = h.streams[rid].rejection
        assert rejection is not None and rejection.gate is Gate.NO_WORKER
        assert "WORKER_RECOVERY_S=20" in rejection.message
    assert not h.core._requests and not h.core._waiting_by_client and not len(h.core._recovery)
    _restart(h)                      # a late worker finds nothing to resume
    assert not h.step()


def test_requests_waiting_for_a_worker_can_be_cancelled() -> None:
    h = _lone()
    running = h.submit(PROMPT, max_tokens=12).request_id
    h.step()
    h.step()
    _kill(h)
    parked = h.submit(OTHER, max_tokens=4).request_id
    assert h.cancel(running) and h.cancel(parked)
    assert h.streams[running].finish.reason is FinishReason.CANCELLED
    assert h.streams[parked].finish.reason is FinishReason.CANCELLED
    assert not h.core._requests and not h.core._waiting_by_client and not len(h.core._recovery)
    _restart(h)
    assert not h.step()


def test_recovery_off_ends_them_at_once_as_before() -> None:
    h = _lone(worker_recovery_s=0)
    running = h.submit(PROMPT, max_tokens=12).request_id
    h.step()
    _kill(h)
    assert h.streams[running].finish.message.endswith("no worker is left to resume it")
    assert h.submit(PROMPT).rejection.gate is Gate.NO_WORKER


def test_before_any_worker_registered_a_request_is_refused_as_before() -> None:
    h = Harness(CoreConfig(worker_recovery_s=60.0), {})
    assert h.submit(PROMPT).rejection.gate is Gate.NO_WORKER


def test_a_parked_request_holds_its_tenants_quota_while_it_waits() -> None:
    # A tenant cannot flood the wait for a worker past its own limits.
    h = _lone()
    _kill(h)
    quota = TenantQuota(max_in_flight=2)
    first = [h.submit(PROMPT, max_tokens=4, client_id="mallory", quota=quota) for _ in range(2)]
    assert all(r.accepted for r in first)
    third = h.submit(PROMPT, max_tokens=4, client_id="mallory", quota=quota)
    assert third.rejection is not None and third.rejection.gate is Gate.QUOTA
    assert h.core.tenant_usage("mallory").in_flight == 2
    assert h.submit(PROMPT, max_tokens=4, client_id="alice", quota=quota).accepted
    _restart(h)
    h.run()
    assert h.core.tenant_usage("mallory").in_flight == 0


def test_a_request_past_max_migrations_ends_instead_of_waiting() -> None:
    h = _lone(max_migrations=0)
    running = h.submit(PROMPT, max_tokens=12).request_id
    h.step()
    h.step()
    _kill(h)
    finish = h.streams[running].finish
    assert finish is not None and "MAX_MIGRATIONS=0" in finish.message
    assert not len(h.core._recovery)
