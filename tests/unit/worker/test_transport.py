"""The worker's gRPC transport over a real engine on a tiny model."""

from __future__ import annotations

import asyncio

import grpc
from fairserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from common.block_hash import prompt_hashes
from common.transport.grpc_server import GrpcServer, check_health
from services.kvcache.kv_types import BlockStored, PublishBatch, PublishResult
from services.kvcache.publisher import KvEventPublisher
from services.worker.kv_events import add_events, snapshot_source
from services.worker.metrics import WorkerMetrics
from services.worker.server import EngineThread, WorkerService
from tests.unit.worker.engine_helpers import make_engine


async def _start(service: WorkerService) -> GrpcServer:
    server = GrpcServer([(worker_pb2_grpc.add_WorkerServicer_to_server, service)],
                        ["fairserve.v1.Worker"], "127.0.0.1", 0)
    await server.start()
    await server.set_serving(True)
    return server


def _new(seq_id: str, prompt: list[int]) -> worker_pb2.NewSequence:
    return worker_pb2.NewSequence(seq_id=seq_id, prompt_token_ids=prompt,
                                  sampling=common_pb2.SamplingParams(temperature=0.0))


async def _scenario() -> None:
    engine = EngineThread(make_engine("gemma3", num_blocks=64, block_size=4))
    registry = CollectorRegistry()
    sent: list[PublishBatch] = []

    async def send(batch: PublishBatch) -> PublishResult:
        sent.append(batch)
        return PublishResult(resync_needed=False, next_seq=batch.snapshot_seq + 1 + len(batch.events)
                             if batch.full_resync else batch.events[-1].seq + 1)

    publisher = KvEventPublisher("w-test", send, snapshot_source(engine.snapshot))
    service = WorkerService(engine, "w-test", WorkerMetrics(registry, "w-test"),
                            on_block_events=lambda events: add_events(publisher, events),
                            kv_events_unacknowledged=lambda: publisher.unacknowledged)
    server = await _start(service)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            assert await check_health(channel, "fairserve.v1.Worker")
            stub = worker_pb2_grpc.WorkerStub(channel)
            info = await stub.Info(worker_pb2.InfoRequest())
            assert info.block_size == 4 and info.num_blocks == 64 and info.worker_id == "w-test"

            prompt = list(range(3, 14))  # 11 tokens: two full blocks and a partial one
            reply = await stub.Step(worker_pb2.StepRequest(
                step_id=1, new_sequences=[_new("a", prompt)], work=[worker_pb2.WorkItem(seq_id="a", num_tokens=6)]))
            first = reply.results[0]
            assert first.num_computed_tokens == 6 and not first.sampled
            reply = await stub.Step(worker_pb2.StepRequest(
                step_id=2, work=[worker_pb2.WorkItem(seq_id="a", num_tokens=64)]))
            assert reply.step_id == 2 and reply.results[0].sampled
            assert reply.results[0].num_computed_tokens == len(prompt)
            assert reply.pool.used_blocks == 3

            unknown = await stub.Step(worker_pb2.StepRequest(
                step_id=3, work=[worker_pb2.WorkItem(seq_id="missing", num_tokens=1)]))
            assert unknown.results[0].error

            await stub.Step(worker_pb2.StepRequest(step_id=4, free_seq_ids=["a"]))
            stats = await stub.Stats(common_pb2.StatsRequest())
            assert stats.running_sequences == 0 and stats.steps == 4
            assert stats.pool.used_blocks == 0 and stats.pool.cached_blocks >= 2
            assert stats.kv_events_unacknowledged == 1   # the first flush (a resync) is still due
            assert await publisher.flush()
            stats = await stub.Stats(common_pb2.StatsRequest())
            assert stats.kv_events_unacknowledged == 0
            await stub.Step(worker_pb2.StepRequest(
                step_id=5, new_sequences=[_new("b", list(range(20, 29)))],
                work=[worker_pb2.WorkItem(seq_id="b", num_tokens=64)]))
            stats = await stub.Stats(common_pb2.StatsRequest())
            assert stats.kv_events_unacknowledged == publisher.unacknowledged > 0

        assert await publisher.flush()
        snapshot = sent[0]
        assert snapshot.full_resync
        stored = [chain for batch in sent for chain in batch.snapshot] + [
            event.body for batch in sent for event in batch.events]
        assert any(len(getattr(body, "block_hashes", ())) >= 2 for body in stored)
        # The freed prompt ends inside its kept partial block: the snapshot names it.
        partial = prompt_hashes(prompt, 4, "gemma3")
        assert BlockStored(partial.block_hashes[-1], (), partial.partial_hash) in snapshot.snapshot
        exported = generate_latest(registry).decode()
        assert 'fairserve_worker_kv_blocks{state="cached",worker="w-test"}' in exported
    finally:
        await server.stop()
        engine.shutdown()


def test_worker_transport_end_to_end() -> None:
    asyncio.run(_scenario())


async def _stream_scenario() -> None:
    engine = EngineThread(make_engine("gemma3", num_blocks=64, block_size=4))
    service = WorkerService(engine, "w-test", WorkerMetrics(CollectorRegistry(), "w-test"))
    server = await _start(service)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            prompt = list(range(3, 14))
            steps = stub.StepStream()
            # A prefill, then a decode sent before the prefill's reply (pipelined), as the scheduler does.
            await steps.write(worker_pb2.StepRequest(step_id=1, epoch=5, new_sequences=[_new("a", prompt)],
                                                     work=[worker_pb2.WorkItem(seq_id="a", num_tokens=64)]))
            await steps.write(worker_pb2.StepRequest(
                step_id=2, after_step_id=1, epoch=5, work=[worker_pb2.WorkItem(seq_id="a", num_tokens=1)]))
            first, second = await steps.read(), await steps.read()
            assert (first.step_id, second.step_id) == (1, 2)
            assert first.results[0].sampled and second.results[0].sampled
            assert second.results[0].num_computed_tokens == len(prompt) + 1

            # The same steps through a call each give the same tokens.
            prefill = await stub.Step(worker_pb2.StepRequest(step_id=3, epoch=5, new_sequences=[_new("b", prompt)],
                                                             work=[worker_pb2.WorkItem(seq_id="b", num_tokens=64)]))
            decode = await stub.Step(worker_pb2.StepRequest(step_id=4, epoch=5,
                                                            work=[worker_pb2.WorkItem(seq_id="b", num_tokens=1)]))
            assert [r.results[0].token_id for r in (prefill, decode)] == [
                r.results[0].token_id for r in (first, second)]

            # A step the engine refuses (of an earlier scheduler registration) ends the stream
            # with its error; the worker serves on.
            await steps.write(worker_pb2.StepRequest(step_id=5, epoch=2))
            try:
                await steps.read()
                raise AssertionError("the refused step did not end the stream")
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            reply = await stub.Step(worker_pb2.StepRequest(step_id=6, epoch=5, free_seq_ids=["a", "b"]))
            assert reply.step_id == 6
    finally:
        await server.stop()
        engine.shutdown()


def test_worker_steps_over_one_stream() -> None:
    asyncio.run(_stream_scenario())
