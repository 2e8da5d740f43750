"""The real gRPC scheduler with one fake worker that dies and comes back: the
stream waits for it (WORKER_RECOVERY_S) and ends as an undisturbed run does."""

from __future__ import annotations

import asyncio

from fairserve.v1 import scheduler_pb2

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.test_transport import PROMPT, _request, make_stack  # noqa: F401 (the fixture)


async def test_a_lone_workers_stream_waits_for_its_restart_and_ends_identical(make_stack) -> None:
    stack = await make_stack(worker_recovery_s=30.0)
    worker = await stack.add_worker(step_delay_s=0.01)
    stream = aiter(stack.stub.Generate(_request("survivor", max_tokens=60), timeout=20))
    events = [await anext(stream)]
    await worker.stop()                  # its steps fail: no worker is left
    stack.workers.clear()
    await _until_waiting(stack)
    late = stack.stub.Generate(_request("late", max_tokens=5), timeout=20)   # queues, not refused
    await stack.add_worker(engine=FakeEngine(num_blocks=1024))
    events += [e async for e in stream]
    tokens = [t.token_id for e in events for t in e.tokens]
    assert tokens == reference_output(PROMPT, 60)
    assert events[-1].finish.finish_reason == "length" and events[-1].finish.usage.completion_tokens == 60
    late_tokens = [t.token_id for e in [e async for e in late] for t in e.tokens]
    assert late_tokens == reference_output(PROMPT, 5)


async def _until_waiting(stack, timeout_s: float = 5.0) -> scheduler_pb2.SchedulerStats:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await stack.stats()
        if stats.waiting_for_worker and not stats.workers:
            assert stats.worker_recovery_s == 30.0
            return stats
        assert asyncio.get_running_loop().time() < deadline, "the request never waited for a worker"
        await asyncio.sleep(0.02)
