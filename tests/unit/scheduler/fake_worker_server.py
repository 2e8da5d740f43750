"""A Worker gRPC server over the fake engine, for transport tests."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

from common.transport.grpc_server import GrpcServer, internal_channel
from common.transport.internal_auth import InternalAuth
from common.transport.worker_auth import worker_token_interceptors
from common.step_convert import step_batch_from_proto, step_output_to_proto
from services.worker.step_order import StepOrder
from services.worker.step_stream import replies_in_order

from tests.unit.scheduler.fake_worker import EOS_TOKEN_ID, FakeEngine


class FakeWorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: FakeEngine, worker_id: str, step_delay_s: float = 0.0) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.step_delay_s = step_delay_s
        self.running = asyncio.Event()  # cleared: Step blocks, as a hung worker would
        self.running.set()
        self.order = StepOrder()
        self.executed: list[tuple[int, int]] = []   # (step_id, after_step_id) in the order steps ran
        self.epochs: list[int] = []                 # each step's epoch, in the same order
        self.calls: Counter[str] = Counter()        # calls opened, by method: "Step", "StepStream"

    async def Step(self, request: worker_pb2.StepRequest, context: grpc.aio.ServicerContext) -> worker_pb2.StepResponse:
        self.calls["Step"] += 1
        return await self._step(request)

    async def StepStream(self, requests, context: grpc.aio.ServicerContext):
        self.calls["StepStream"] += 1
        async for reply in replies_in_order(requests, self._step):
            yield reply

    async def _step(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        async with self.order.turn(request.step_id, request.after_step_id, request.epoch):
            self.executed.append((request.step_id, request.after_step_id))
            self.epochs.append(request.epoch)
            await self.running.wait()
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)
            outcome = self.engine.step(step_batch_from_proto(request))
        return step_output_to_proto(outcome)

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(worker_id=self.worker_id, model_name="fake", block_size=self.engine.block_size,
                                     num_blocks=self.engine.num_blocks, device="cpu", dtype="none",
                                     max_model_len=self.engine.max_model_len, eos_token_ids=[EOS_TOKEN_ID],
                                     vocab_size=1000)


class FakeWorkerProcess:
    """The fake worker's server plus its registration and heartbeats."""

    def __init__(self, engine: FakeEngine, worker_id: str, scheduler_addr: str,
                 step_delay_s: float = 0.0, auth: InternalAuth = InternalAuth(),
                 worker_token: bytes = b"", host: str = "127.0.0.1") -> None:
        self.servicer = FakeWorkerServicer(engine, worker_id, step_delay_s)
        self.worker_id = worker_id
        self._scheduler_addr = scheduler_addr
        self._host = host
        self._server = GrpcServer([(worker_pb2_grpc.add_WorkerServicer_to_server, self.servicer)],
                                  ["fairserve.v1.Worker"], host, 0, auth)
        self._heartbeats: asyncio.Task[None] | None = None
        self._channel = internal_channel(scheduler_addr, auth, worker_token_interceptors(worker_token))
        self.epoch = 0   # of its registration

    @property
    def address(self) -> str:
        return f"{self._host}:{self._server.port}"

    @property
    def engine(self) -> FakeEngine:
        return self.servicer.engine

    async def start(self, heartbeat_s: float = 0.05) -> None:
        await self._server.start()
        stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        await self._register(stub)
        self._heartbeats = asyncio.create_task(self._beat(stub, heartbeat_s))

    async def _register(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        reply = await stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(
            worker_id=self.worker_id, address=self.address), timeout=5)
        self.epoch = reply.epoch

    async def _beat(self, stub: scheduler_pb2_grpc.SchedulerStub, interval_s: float) -> None:
        """Heartbeats; registers again when the scheduler no longer knows it
        (a late heartbeat on a loaded machine timed it out), as a real worker does."""
        while True:
            reply = await stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id=self.worker_id), timeout=5)
            if not reply.known:
                await self._register(stub)
            await asyncio.sleep(interval_s)

    def stop_heartbeats(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()

    async def stop(self) -> None:
        self.stop_heartbeats()
        await self._server.stop(0)
        await self._channel.close()
