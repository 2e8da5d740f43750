"""Many simulated workers in one process: each is the real WorkerService (services/worker/server.py)
over a SimEngine (sim_engine.py), on a gRPC server of its own, registering and heartbeating with
the scheduler through the real `keep_registered`, the worker token included when one is set
(WORKER_TOKEN / INTERNAL_TOKEN, as a real worker reads them), and publishing its prefix cache's
block events (sim_prefix_cache.py) to the kvcache index at KVCACHE_ADDR through the real
`KvEventPublisher`, as a real worker does (none without KVCACHE_ADDR).

The engine thread is replaced by `SimEngineThread`: a step's bookkeeping runs on the event loop,
then the step's modelled time is waited out against the worker's own clock (a step queued behind
another starts when that one ends, as on a device), so loop lag is not added to the model.

    python -m benchmarks.sim_workers --count 64 --scheduler 127.0.0.1:50051 [--slowdown 1]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import json
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

from fairserve.v1 import worker_pb2, worker_pb2_grpc
from prometheus_client import CollectorRegistry

from benchmarks.sim_engine import SimEngine, StepCosts
from services.kvcache.client import KvIndexClient
from services.kvcache.publisher import KvEventPublisher
from common.transport.grpc_server import GrpcServer, internal_channel
from common.transport.internal_auth import InternalAuth
from common.shutdown import stop_requests
from common.transport.worker_auth import worker_token_from_env, worker_token_interceptors
from services.worker.kv_events import add_events, snapshot_source
from services.worker.metrics import WorkerMetrics
from services.worker.server import EngineThread, WorkerService, keep_registered

log = logging.getLogger("sim_workers")
KV_PUBLISH_INTERVAL_S = 0.05    # the worker's default (KV_PUBLISH_INTERVAL_S)
T = TypeVar("T")


class SimEngineThread(EngineThread):
    """Runs the simulated engine's calls inline, then waits out the step's modelled time. A step
    starts on the modelled device when it reached the worker or when the step before it ended,
    whichever is later: not when this process's loop, shared by every simulated worker, gets to
    it (a real worker's loop is its own and idle while its device runs)."""

    def __init__(self, engine: SimEngine) -> None:
        super().__init__(engine)   # type: ignore[arg-type]   (the engine's duck type)
        self._sim = engine
        self._free_at = 0.0
        self._arrivals: dict[int, float] = {}   # step id -> when it reached the worker
        # Per step: its start (time.monotonic, the same clock in every process), the device's idle
        # time before it (from the previous step's end) and its modelled duration.
        self.steps: list[tuple[float, float, float]] = []

    def arrived(self, step_id: int) -> None:
        if len(self._arrivals) > 64:      # steps refused before they ran
            self._arrivals.clear()
        self._arrivals[step_id] = time.monotonic()

    async def run(self, function: Callable[[], T]) -> T:
        result = function()
        pending, self._sim.pending_s = self._sim.pending_s, 0.0
        if pending > 0:
            now = time.monotonic()
            start = max(min(self._arrivals.pop(self._sim.last_step_id, now), now), self._free_at)
            self.steps.append((start, max(0.0, start - self._free_at) if self._free_at else 0.0, pending))
            self._free_at = start + pending
            await asyncio.sleep(self._free_at - now)
        return result


class SimWorkerService(WorkerService):
    """The real worker service, noting when each step reaches it (SimEngineThread.arrived)."""

    def __init__(self, thread: SimEngineThread, *args, **kwargs) -> None:
        super().__init__(thread, *args, **kwargs)
        self._sim_thread = thread

    async def _step(self, request: worker_pb2.StepRequest, context) -> worker_pb2.StepResponse:
        self._sim_thread.arrived(request.step_id)
        return await super()._step(request, context)


class SimWorker:
    def __init__(self, index: int, costs: StepCosts, host: str, internal: InternalAuth,
                 kv_index: KvIndexClient | None = None, model_key: str = "", name: str = "sim-") -> None:
        self.worker_id = f"{name}{index}"
        self.thread = SimEngineThread(SimEngine(costs, model_key=model_key))
        metrics = WorkerMetrics(CollectorRegistry(), self.worker_id, self.thread.engine.pool_stats(),
                                {"device": "simulated"})
        self.publisher = (KvEventPublisher(self.worker_id, kv_index.publish, snapshot_source(self.thread.snapshot))
                          if kv_index is not None else None)
        self.service = SimWorkerService(
            self.thread, self.worker_id, metrics,
            on_block_events=partial(add_events, self.publisher) if self.publisher else None,
            kv_events_unacknowledged=lambda: self.publisher.unacknowledged if self.publisher else 0)
        self.server = GrpcServer([(worker_pb2_grpc.add_WorkerServicer_to_server, self.service)],
                                 [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
                                 host, 0, internal)


def write_stats(workers: list[SimWorker], path: str) -> None:
    """Every worker's steps: [start, idle gap before it, modelled duration] in seconds."""
    steps = [[round(value, 6) for value in step] for worker in workers for step in worker.thread.steps]
    Path(path).write_text(json.dumps({"steps": steps, "workers": len(workers)}))


async def serve(count: int, scheduler: str, costs: StepCosts, host: str = "127.0.0.1",
                env: dict[str, str] | None = None, stats_out: str | None = None, name: str = "sim-") -> None:
    env = dict(os.environ if env is None else env)
    internal = InternalAuth.from_env(env)
    token = worker_token_from_env(env, internal.token)
    # One index connection for all of them (a real worker has its own; the index tells them
    # apart by worker id).
    kv_index = KvIndexClient.connect(env["KVCACHE_ADDR"], auth=internal) if env.get("KVCACHE_ADDR") else None
    workers = [SimWorker(index, costs, host, internal, kv_index, env.get("MODEL_KEY", ""), name)
               for index in range(count)]
    for worker in workers:
        await worker.server.start()
        await worker.server.set_serving(True)
    channel = internal_channel(scheduler, internal, worker_token_interceptors(token))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(keep_registered(channel, w.worker_id, f"{host}:{w.server.port}", w.service,
                                                 1.0, stop)) for w in workers]
    tasks += [asyncio.create_task(w.publisher.run(KV_PUBLISH_INTERVAL_S, stop)) for w in workers if w.publisher]
    log.warning("simulated workers serving", extra={"count": count, "scheduler": scheduler})
    stops = stop_requests()
    await stops.graceful.wait()
    stop.set()
    if stats_out:
        write_stats(workers, stats_out)
    await asyncio.gather(*tasks, return_exceptions=True)
    for worker in workers:
        await worker.server.stop(0.2)
    await channel.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--scheduler", default="127.0.0.1:50051")
    parser.add_argument("--slowdown", type=float, default=1.0, help="every step this many times as long")
    parser.add_argument("--stats-out", help="write the steps' idle gaps here (JSON) on SIGTERM")
    parser.add_argument("--costs", help="JSON step costs (sim_engine.StepCosts.from_json)")
    parser.add_argument("--name", default="sim-", help="worker ids are this and an index")
    args = parser.parse_args(argv)
    costs = (StepCosts.from_json(args.costs) if args.costs else StepCosts()).scaled(args.slowdown)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(serve(args.count, args.scheduler, costs, stats_out=args.stats_out, name=args.name))


if __name__ == "__main__":
    main()
