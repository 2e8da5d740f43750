"""Worker faults through the real gRPC scheduler: a sequence the worker fails
alone (STEP_ERROR_INTERNAL) ends its request with an error message while the
others on the worker go on; a worker whose step hangs (while it still
heartbeats) leaves the rotation when the step's deadline (STEP_TIMEOUT_S)
passes, over the step stream or a call per step, and its request resumes on
another worker with nothing lost. And the scheduler's settings and gauge for
its view of the KV index."""

from __future__ import annotations

import pytest
from fairserve.v1 import scheduler_pb2
from prometheus_client import generate_latest

from common.settings.env import SettingsError
from common.step import SeqResult, StepError
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.settings import SchedulerSettings

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.test_transport import PROMPT, _request, make_stack  # noqa: F401  (fixture)

POISON = 999


class PoisonEngine(FakeEngine):
    """Fails, alone, every sequence whose tokens hold POISON (as the worker's engine does
    with a sequence whose forward raises)."""

    def _work(self, seq_id: str, max_tokens: int, draft_tokens: int = 0) -> SeqResult:
        seq = self.seqs.get(seq_id)
        if seq is not None and POISON in seq.tokens:
            return SeqResult(seq_id=seq_id, num_computed_tokens=seq.computed, error=StepError.INTERNAL)
        return super()._work(seq_id, max_tokens, draft_tokens)


async def test_a_sequence_failed_alone_ends_its_request_and_the_others_go_on(make_stack) -> None:
    stack = await make_stack()
    await stack.add_worker("w0", engine=PoisonEngine(num_blocks=1024))
    good = stack.stub.Generate(_request("good", max_tokens=12), timeout=10)
    bad = stack.stub.Generate(scheduler_pb2.GenerateRequest(
        request_id="bad", prompt_token_ids=(*PROMPT, POISON), max_tokens=12), timeout=10)
    bad_events = [event async for event in bad]
    assert bad_events[-1].finish.finish_reason == "error"
    assert "w0" in bad_events[-1].finish.message and "internal" in bad_events[-1].finish.message
    good_events = [event async for event in good]
    assert [t.token_id for e in good_events for t in e.tokens] == reference_output(PROMPT, 12)
    stats = await stack.stats()
    assert [worker.worker_id for worker in stats.workers] == ["w0"] and stats.migrations == 0


@pytest.mark.parametrize("transport", ["stream", "unary"])
async def test_a_step_past_its_deadline_fails_the_worker_and_its_request_moves(make_stack, transport) -> None:
    stack = await make_stack(step_timeout_s=0.3, worker_heartbeat_timeout_s=30.0, step_transport=transport)
    hung = await stack.add_worker("w0", step_delay_s=0.005)
    stream = aiter(stack.stub.Generate(_request("r", max_tokens=30), timeout=10))
    first = await anext(stream)
    hung.servicer.running.clear()     # its next steps hang; its heartbeats go on (dropped, it registers again)
    await stack.add_worker("w1")
    rest = [event async for event in stream]
    tokens = [token.token_id for event in (first, *rest) for token in event.tokens]
    assert tokens == reference_output(PROMPT, 30)
    assert rest[-1].finish.finish_reason == "length"
    stats = await stack.stats()
    assert "w1" in [worker.worker_id for worker in stats.workers] and stats.migrations == 1
    assert hung.servicer.calls[{"stream": "StepStream", "unary": "Step"}[transport]] >= 1
    hung.servicer.running.set()


def test_settings_read_the_new_variables() -> None:
    settings = SchedulerSettings.from_env({"STEP_TIMEOUT_S": "0", "MAX_MIGRATIONS": "5", "STEP_TRANSPORT": "unary"})
    assert settings.step_timeout_s == 0 and settings.core_config().max_migrations == 5
    assert settings.step_transport == "unary"
    defaults = SchedulerSettings.from_env({})
    assert defaults.step_timeout_s == 60.0 and defaults.core_config().max_migrations == 2
    assert defaults.step_transport == "stream"
    for name, value in (("STEP_TIMEOUT_S", "-1"), ("MAX_MIGRATIONS", "-1"), ("MAX_MIGRATIONS", "two"),
                        ("STEP_TRANSPORT", "udp")):
        with pytest.raises(SettingsError, match=name):
            SchedulerSettings.from_env({name: value})


def test_the_kv_index_gauge_follows_the_router() -> None:
    metrics = SchedulerMetrics()
    assert b"fairserve_scheduler_kv_index_up 1.0" in generate_latest(metrics.registry)
    metrics.set_kv_index_up(False)
    assert b"fairserve_scheduler_kv_index_up 0.0" in generate_latest(metrics.registry)
