"""Scheduler registrations (epochs) on the worker: a new one frees every sequence
the old ones left, into the prefix cache, so a restarted scheduler leaks no block
and its continuations recompute cheaply and sample on draw for draw; a step of an
older one is refused; registering adopts the new epoch at once, and a worker
the scheduler no longer knows registers again without waiting."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fairserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from prometheus_client import CollectorRegistry

from common.transport.grpc_server import GrpcServer, insecure_channel
from common.types import SamplingParams
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.types import StaleEpoch
from services.worker.metrics import WorkerMetrics
from services.worker.server import EngineThread, WorkerService, keep_registered
from tests.unit.worker.engine_helpers import Driver, make_engine, prompt_of

SEEDED = SamplingParams(temperature=0.8, seed=7)


def test_a_new_epoch_frees_what_the_old_one_left_and_a_continuation_draws_on() -> None:
    prompt = prompt_of(13, 1)
    undisturbed = Driver(make_engine("gemma3")).run({"a": prompt}, 10, sampling={"a": SEEDED})["a"]
    engine = make_engine("gemma3")
    driver = Driver(engine)
    driver.step(StepBatch(epoch=5, new_sequences=[NewSequence("a", prompt, [], SEEDED),
                                                  NewSequence("b", prompt_of(9, 2))],
                          work=[WorkItem("a", 64), WorkItem("b", 64)]))
    for _ in range(3):
        driver.step(StepBatch(epoch=5, work=[WorkItem("a", 1), WorkItem("b", 1)]))
    assert engine.running_sequences() == 2 and engine.pool_stats().used_blocks > 0
    # The scheduler is gone; its successor's first step frees both.
    out = driver.step(StepBatch(epoch=6))
    assert engine.running_sequences() == 0
    assert out.pool.used_blocks == 0 and out.pool.cached_blocks > 0
    # The continuation of "a" from the 3 tokens its client got: cached blocks, same draws.
    streamed = driver.outputs["a"][:3]
    out = driver.step(StepBatch(epoch=6, new_sequences=[NewSequence("a.r1", prompt, streamed, SEEDED)],
                                work=[WorkItem("a.r1", 64)]))
    assert out.results[0].num_cached_tokens == len(prompt) + 3 - 1   # all but the last, which it samples from
    while len(driver.outputs["a.r1"]) < 7:
        driver.step(StepBatch(epoch=6, work=[WorkItem("a.r1", 1)]))
    assert streamed + driver.outputs["a.r1"] == undisturbed
    driver.step(StepBatch(epoch=6, free_seq_ids=["a.r1"]))
    assert engine.pool_stats().used_blocks == 0


def test_a_step_of_an_older_epoch_is_refused_and_changes_nothing() -> None:
    engine = make_engine("gemma3")
    engine.step(StepBatch(epoch=9, new_sequences=[NewSequence("x", prompt_of(6))], work=[WorkItem("x", 64)]))
    with pytest.raises(StaleEpoch):
        engine.step(StepBatch(epoch=8, free_seq_ids=["x"]))
    assert engine.running_sequences() == 1 and engine.epoch == 9
    assert engine.adopt_epoch(9) == 0 and engine.running_sequences() == 1
    assert engine.adopt_epoch(10) == 1 and engine.pool_stats().used_blocks == 0


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Registers anyone under the next epoch; answers heartbeats with `known`."""

    def __init__(self) -> None:
        self.epoch = 100
        self.known = True
        self.registered = asyncio.Event()
        self.registrations = 0
        self.told: list[int] = []     # the epoch each registering worker said it served

    async def RegisterWorker(self, request: scheduler_pb2.RegisterWorkerRequest,
                             context: grpc.aio.ServicerContext) -> scheduler_pb2.RegisterWorkerResponse:
        self.registrations += 1
        self.told.append(request.epoch)
        self.epoch += 1
        self.known = True
        self.registered.set()
        return scheduler_pb2.RegisterWorkerResponse(heartbeat_interval_s=0.05, epoch=self.epoch)

    async def Heartbeat(self, request: scheduler_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> scheduler_pb2.HeartbeatResponse:
        return scheduler_pb2.HeartbeatResponse(known=self.known)


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_registering_frees_the_old_epochs_sequences_and_refuses_its_steps() -> None:
    thread = EngineThread(make_engine("gemma3"))
    service = WorkerService(thread, "w-epoch", WorkerMetrics(CollectorRegistry(), "w-epoch"))
    worker = GrpcServer([(worker_pb2_grpc.add_WorkerServicer_to_server, service)], ["fairserve.v1.Worker"],
                        "127.0.0.1", 0)
    scheduler = FakeScheduler()
    scheduler_server = GrpcServer([(scheduler_pb2_grpc.add_SchedulerServicer_to_server, scheduler)],
                                  ["fairserve.v1.Scheduler"], "127.0.0.1", 0)
    await worker.start()
    await scheduler_server.start()
    stop = asyncio.Event()
    channel = insecure_channel(f"127.0.0.1:{scheduler_server.port}")
    try:
        async with insecure_channel(f"127.0.0.1:{worker.port}") as worker_channel:
            stub = worker_pb2_grpc.WorkerStub(worker_channel)
            await stub.Step(worker_pb2.StepRequest(step_id=1, epoch=50, new_sequences=[worker_pb2.NewSequence(
                seq_id="old", prompt_token_ids=prompt_of(9), sampling=common_pb2.SamplingParams())],
                work=[worker_pb2.WorkItem(seq_id="old", num_tokens=64)]))
            assert thread.engine.running_sequences() == 1
            registration = asyncio.create_task(keep_registered(channel, "w-epoch", "127.0.0.1:1", service, 5.0, stop))
            await _until(lambda: thread.engine.epoch == 101 and service.last_pool.used_blocks == 0)
            assert thread.engine.running_sequences() == 0
            with pytest.raises(grpc.aio.AioRpcError) as stale:
                await stub.Step(worker_pb2.StepRequest(step_id=2, epoch=50))
            assert stale.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            # The scheduler forgets it (a restart): the next heartbeat registers again at once.
            scheduler.known = False
            await _until(lambda: thread.engine.epoch == 102, timeout_s=1.0)
            assert scheduler.registrations == 2 and scheduler.told == [50, 101]
            stop.set()
            await asyncio.wait_for(registration, 5.0)
    finally:
        await channel.close()
        await worker.stop(0)
        await scheduler_server.stop(0)
        thread.shutdown()
