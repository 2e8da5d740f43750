"""The scheduler's gRPC transport: the Scheduler service, one step loop per
worker (workers/step_loop.py: its steps over one StepStream call or a Step call each,
STEP_TRANSPORT, each with a deadline, STEP_TIMEOUT_S), the reaper for silent
workers and queue timeouts, and KV-index lookups for routing (kv_router.py).
All scheduling decisions live in the core."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable

import grpc
from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

from common.transport.grpc_server import GrpcServer, internal_channel, request_id_from
from common.transport.peer import MAX_PEER_CHARS
from common.observability.tracing import traceparent_from_metadata
from common.transport.worker_auth import worker_role_check

from services.scheduler import convert
from services.scheduler.workers.address_check import HostFacts, check_peer_address
from services.scheduler.core.types import Rejection, RequestUpdate, SubmitResult
from services.scheduler.core.scheduler import SchedulerCore
from services.scheduler.detached import DetachedLog
from services.scheduler.workers.epochs import EpochClock
from services.scheduler.kv_router import KvIndexRouter
from services.scheduler.lookup_records import LookupRecords
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request_traces import RequestTraces
from services.scheduler.workers.registration import (
    RegistrationError, check_rebind, check_registration, check_worker_figures,
)
from services.scheduler.settings import SchedulerSettings
from services.scheduler.workers.step_link import step_link
from services.scheduler.workers.step_loop import StepLoop, WorkerLink
from services.scheduler.generate_many import GenerateMany
from services.scheduler.peer_exchange import exchange_with_peers, scheduler_peer_handlers

log = logging.getLogger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
INFO_TIMEOUT_S = 10.0
MAX_REAPER_INTERVAL_S = 0.25


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, settings: SchedulerSettings, metrics: SchedulerMetrics,
                 clock: Callable[[], float] = time.monotonic,
                 new_id: Callable[[], str] = lambda: uuid.uuid4().hex, hosts: HostFacts = HostFacts()) -> None:
        self._settings = settings
        self._metrics = metrics
        self._hosts = hosts
        self._core = SchedulerCore(settings.core_config(), clock, new_id)
        self._instance_id = new_id()      # told to peer shards, so that one naming itself leaves it out
        self._epochs = EpochClock()
        self._kv = KvIndexRouter(settings.kvcache_addr, clock, auth=settings.internal,
                                 on_availability=metrics.set_kv_index_up)
        self._streams: dict[str, Callable[[RequestUpdate], None]] = {}   # where each request's updates go
        self._traces = RequestTraces()     # spans of traced requests (request_traces.py)
        self._links: dict[str, WorkerLink] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._background_tasks: set[asyncio.Task[object]] = set()
        self._detached = DetachedLog(settings.detached_ttl_s, clock)
        self._many = GenerateMany(self._admit, self._end_stream, self._finished)
        # Requests admitted without asking the index (one worker) -> the id its log line takes.
        self._unasked: dict[str, str] = {}
        self._records = LookupRecords(self._kv.record_lookups)

    async def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap())
        self._background(self._records.run())
        if self._settings.peers:
            self._background(exchange_with_peers(
                self._settings.peers, self._settings.peer_exchange_s, self._settings.internal,
                scheduler_peer_handlers(self._core, self._metrics), self._instance_id))

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._background_tasks):
            task.cancel()
        for worker_id in list(self._links):
            await self._unlink(worker_id)
        await self._records.flush()
        await self._kv.close()

    # ---- Scheduler RPCs ----

    async def Generate(self, request: scheduler_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.GenerateEvent]:
        queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        result = await self._admit(request, request_id_from(context) or "",
                                   traceparent_from_metadata(context.invocation_metadata()), queue.put_nowait)
        if result.rejection is not None:
            await self._refuse(context, result.rejection)
        request_id = result.request_id
        ended = False
        reason = "cancelled"
        try:
            while True:
                update = await queue.get()
                if update.rejection is not None:
                    ended = True
                    await self._refuse(context, update.rejection)
                finished = update.finish is not None
                if finished:
                    # Before the yield: a client that closes the call once it has the last event
                    # (the generator then never resumes) did not cancel a finished request.
                    ended = True
                    reason = update.finish.reason.value
                    self._finished(request_id, update)
                yield convert.generate_event_to_proto(update, request.packed_tokens)
                if finished:
                    return
        finally:
            self._end_stream(request_id, ended, reason, request.detached)

    async def GenerateMany(self, request_iterator: AsyncIterator[scheduler_pb2.StreamRequest],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.StreamEvents]:
        async for message in self._many.serve(request_iterator, context):
            yield message

    async def _admit(self, request: scheduler_pb2.GenerateRequest, trace_id: str, traceparent: str,
                     sink: Callable[[RequestUpdate], None]) -> SubmitResult:
        """Submits a request to the core (after asking the index where its prompt is
        cached); once admitted, its updates go to `sink` and its worker is woken."""
        spec = convert.request_spec_from_proto(request)
        hints: dict[str, int] = {}
        # With one worker there is nothing to route: the index is not asked, and the lookup is
        # recorded when the request ends, from what its worker reused (lookup_records.py).
        # A gateway over shards asked already, to pick this shard: its answer is used.
        workers = self._core.worker_ids()
        if request.index_asked:
            hints = dict(request.cached_prefix_tokens)
        elif len(workers) > 1:
            hints = await self._kv.cached_prefix_tokens(spec.prompt_token_ids, trace_id or spec.request_id,
                                                        spec.cache_salt)
        result = self._core.submit(spec, hints)
        if len(workers) == 1 and not request.index_asked and result.rejection is None:
            self._unasked[result.request_id] = trace_id or spec.request_id
        if request.detached and result.rejection is None:
            self._detached.open(result.request_id, request, spec.client_id, request.authenticated)
        if result.rejection is not None:
            log.info("request rejected", extra={"gate": result.rejection.gate.value,
                                                "reason": result.rejection.message})
            return result
        self._traces.start(result.request_id, traceparent, (trace_id,) if trace_id else ())
        log.info("request queued", extra={"scheduler_request_id": result.request_id, "worker_id": result.worker_id,
                                          "client_id": spec.client_id, "prompt_tokens": len(spec.prompt_token_ids),
                                          "max_tokens": spec.max_tokens, "cached_prefix_tokens": hints,
                                          "resumed_tokens": len(spec.resume_token_ids)})
        self._streams[result.request_id] = sink
        self._wake(result.worker_id)
        return result

    def _end_stream(self, request_id: str, ended: bool, reason: str, detached: bool) -> None:
        """A request's events stop going to its caller: it ended, or its caller left
        (then it is cancelled, unless detached)."""
        self._streams.pop(request_id, None)
        self._unasked.pop(request_id, None)
        self._traces.finished(request_id, reason)
        if not ended and detached:
            log.info("the caller of a detached request left; it goes on",
                     extra={"scheduler_request_id": request_id})
        elif not ended:  # the client went away: stop generating for it
            log.info("request cancelled by the client", extra={"scheduler_request_id": request_id})
            self._cancel(request_id)

    @staticmethod
    async def _refuse(context: grpc.aio.ServicerContext, rejection: Rejection) -> None:
        """Ends a Generate call with the rejection's status, marked as a refusal."""
        await context.abort(convert.REJECTION_CODES[rejection.gate], rejection.message,
                            trailing_metadata=convert.rejection_metadata(rejection))

    def _background(self, work: Coroutine[object, object, object]) -> None:
        task = asyncio.create_task(work)
        self._background_tasks.add(task)    # a reference, so the task is not collected mid-flight
        task.add_done_callback(self._background_tasks.discard)

    async def Cancel(self, request: scheduler_pb2.CancelRequest,
                     context: grpc.aio.ServicerContext) -> scheduler_pb2.CancelResponse:
        request_id_from(context)
        return scheduler_pb2.CancelResponse(found=self._cancel(request.request_id))

    async def Attach(self, request: scheduler_pb2.AttachRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.GenerateEvent]:
        """A detached request's events from its first (detached.py)."""
        entry = self._detached.get(request.request_id, request.client_id)
        if entry is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no detached request {request.request_id!r}")
        assert entry is not None
        async for update in self._detached.follow(entry):
            if update.rejection is not None:
                await self._refuse(context, update.rejection)
            yield convert.generate_event_to_proto(update)

    async def GetDetached(self, request: scheduler_pb2.AttachRequest,
                          context: grpc.aio.ServicerContext) -> scheduler_pb2.GenerateRequest:
        entry = self._detached.get(request.request_id, request.client_id)
        if entry is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no detached request {request.request_id!r}")
        assert entry is not None
        return entry.request  # type: ignore[return-value]

    async def Stats(self, request: object, context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerStats:
        stats = convert.stats_to_proto(self._core.stats())
        stats.instance_id = self._instance_id
        return stats

    async def GetModelInfo(self, request: scheduler_pb2.ModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> scheduler_pb2.ModelInfo:
        return convert.model_info_to_proto([link.info for link in self._links.values()],
                                           self._settings.kv_policy)

    async def RegisterWorker(self, request: scheduler_pb2.RegisterWorkerRequest,
                             context: grpc.aio.ServicerContext) -> scheduler_pb2.RegisterWorkerResponse:
        channel = None
        try:
            await self._check_registration(request, context.peer())    # before dialing anything
            channel = internal_channel(request.address, self._settings.internal)
            stub = worker_pb2_grpc.WorkerStub(channel)
            info = await stub.Info(worker_pb2.InfoRequest(), timeout=INFO_TIMEOUT_S)
            check_worker_figures(convert.worker_figures_from_proto(info), request.worker_id)
            self._check_rebind(request)     # another registration of the id may have won meanwhile
        except (grpc.aio.AioRpcError, RegistrationError) as error:
            if channel is not None:
                await channel.close()
            code, message = convert.registration_status(error, request.worker_id, request.address)
            log.warning("worker registration refused", extra={"code": code.name, "reason": message,
                                                              "peer": context.peer()[:MAX_PEER_CHARS]})
            await context.abort(code, message)
        await self._unlink(request.worker_id)
        spec = convert.worker_spec_from_proto(info, request.worker_id, request.address,
                                              self._epochs.next(after=request.epoch))
        self._deliver(self._core.add_worker(spec))
        self._metrics.add_worker(spec.worker_id)
        link = WorkerLink(worker_id=spec.worker_id, address=spec.address, channel=channel, stub=stub,
                           info=info)
        link.task = asyncio.create_task(self._run_worker(link), name=f"worker-loop-{spec.worker_id}")
        self._links[spec.worker_id] = link
        log.info("worker registered", extra={"worker_id": spec.worker_id, "address": spec.address,
                                             "num_blocks": spec.num_blocks, "block_size": spec.block_size,
                                             "max_model_len": spec.max_model_len, "epoch": spec.epoch})
        self._wake_all()
        return scheduler_pb2.RegisterWorkerResponse(heartbeat_interval_s=self._settings.heartbeat_interval_s,
                                                    epoch=spec.epoch)

    async def _check_registration(self, request: scheduler_pb2.RegisterWorkerRequest, peer: str) -> None:
        """The fields, the id's binding, and that the address is the caller's (address_check.py)."""
        check_registration(request.worker_id, request.address)
        self._check_rebind(request)
        if self._settings.registration_address_check == "peer":
            await check_peer_address(request.address, peer, self._hosts)

    def _check_rebind(self, request: scheduler_pb2.RegisterWorkerRequest) -> None:
        link = self._links.get(request.worker_id)
        check_rebind(request.worker_id, request.address, link.address if link is not None else None)

    async def Heartbeat(self, request: scheduler_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> scheduler_pb2.HeartbeatResponse:
        return scheduler_pb2.HeartbeatResponse(known=self._core.heartbeat(request.worker_id))

    async def DrainWorker(self, request: scheduler_pb2.DrainWorkerRequest,
                          context: grpc.aio.ServicerContext) -> scheduler_pb2.DrainWorkerResponse:
        """A worker leaving asks until nothing is left on it (core/drain.py); then it is dropped."""
        worker_id = request.worker_id
        self._core.heartbeat(worker_id)
        outcome = self._core.drain_worker(worker_id)
        self._deliver(outcome.updates)
        self._wake_all()
        if outcome.started:
            log.info("worker draining", extra={"worker_id": worker_id, "moved": outcome.moved,
                                               "remaining": outcome.remaining})
        if outcome.drained:
            await self._drop_worker(worker_id, f"worker {worker_id} drained")
        return scheduler_pb2.DrainWorkerResponse(known=outcome.known, moved=outcome.moved,
                                                 remaining=outcome.remaining)

    # ---- the per-worker step loop (workers/step_loop.py) ----

    async def _run_worker(self, link: WorkerLink) -> None:
        steps = step_link(self._settings.step_transport, link.stub, self._settings.step_timeout_s or None)
        await StepLoop(link, self._core, steps, self._metrics, self._traces, self._deliver, self._drop_worker,
                       lambda: self._links.get(link.worker_id) is link).run()

    async def _drop_worker(self, worker_id: str, message: str) -> None:
        log.warning("worker left the rotation", extra={"worker_id": worker_id, "reason": message})
        self._deliver(self._core.remove_worker(worker_id, message))
        await self._unlink(worker_id)
        self._wake_all()

    async def _unlink(self, worker_id: str) -> None:
        link = self._links.pop(worker_id, None)
        if link is None:
            return
        if link.task is not None and link.task is not asyncio.current_task():
            link.task.cancel()
        self._metrics.forget_worker(worker_id)
        await link.channel.close()

    async def _reap(self) -> None:
        interval = min(MAX_REAPER_INTERVAL_S, self._settings.worker_heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            outcome = self._core.expire()
            self._deliver(outcome.updates)
            for worker_id in outcome.removed_workers:
                log.warning("worker stopped heartbeating", extra={"worker_id": worker_id})
                await self._unlink(worker_id)
            if outcome.removed_workers:
                self._wake_all()
            self._metrics.publish(self._core.stats())

    # ---- helpers ----

    def _finished(self, request_id: str, update: RequestUpdate) -> None:
        """A request's finish reached its caller: logged, and its lookup recorded when the
        index was not asked (one worker)."""
        self._log_finish(request_id, update)
        unasked = self._unasked.pop(request_id, None)
        if unasked is not None and update.finish is not None:
            usage = update.finish.usage
            self._records.add(usage.prompt_tokens, usage.cached_tokens, unasked)

    @staticmethod
    def _log_finish(request_id: str, update: RequestUpdate) -> None:
        finish = update.finish
        assert finish is not None
        queue_wait_ms = convert.queue_wait_ms(finish)
        log.info("request finished", extra={
            "scheduler_request_id": request_id, "finish_reason": finish.reason.value,
            "prompt_tokens": finish.usage.prompt_tokens, "completion_tokens": finish.usage.completion_tokens,
            "cached_tokens": finish.usage.cached_tokens, "queue_wait_ms": round(queue_wait_ms, 3),
            **({"finish_message": finish.message} if finish.message else {})})

    def _cancel(self, request_id: str) -> bool:
        worker_id = self._core.worker_of(request_id)
        found, updates = self._core.cancel(request_id)
        self._deliver(updates)
        self._wake(worker_id)
        return found

    def _deliver(self, updates: Iterable[RequestUpdate]) -> None:
        for update in updates:
            self._detached.note(update)
            sink = self._streams.get(update.request_id)
            if sink is not None:
                sink(update)

    def _wake(self, worker_id: str | None) -> None:
        link = self._links.get(worker_id) if worker_id else None
        if link is not None:
            link.wake.set()

    def _wake_all(self) -> None:
        for link in self._links.values():
            link.wake.set()


class SchedulerServer:
    """The gRPC server around the service, with health and reflection."""

    def __init__(self, settings: SchedulerSettings, clock: Callable[[], float] = time.monotonic,
                 new_id: Callable[[], str] = lambda: uuid.uuid4().hex, hosts: HostFacts = HostFacts()) -> None:
        self.metrics = SchedulerMetrics()
        self.service = SchedulerService(settings, self.metrics, clock, new_id, hosts)
        # The worker RPCs need the worker token too (common/transport/worker_auth.py).
        self._grpc = GrpcServer([(scheduler_pb2_grpc.add_SchedulerServicer_to_server, self.service)],
                                [SERVICE_NAME], settings.host, settings.port, settings.internal,
                                interceptors=worker_role_check(settings.worker_token))

    @property
    def port(self) -> int:
        return self._grpc.port

    async def start(self) -> None:
        await self._grpc.start()
        await self.service.start()
        await self._grpc.set_serving(True)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self._grpc.stop(grace_s)
        await self.service.close()
