"""Worker process: loads the model, serves Step/Info/Stats, registers with
the scheduler and publishes KV block events to the index.

Run as a program, it first prepares the process (host/process_start.py: OpenMP's spin
bound and one malloc arena), before anything imports torch or starts a thread;
`fairserve worker` does the same (fairserve/cli/schemas.py).
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    from services.worker.host.process_start import prepare_process
    prepare_process()

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import grpc
from fairserve.v1 import worker_pb2, worker_pb2_grpc
from prometheus_client import CollectorRegistry

from common import event_loop
from common.transport.grpc_server import GrpcServer, internal_channel
from common.observability.logs import configure_logging
from common.observability.tracing import setup_tracing, shutdown_tracing
from common.observability.metrics import serve_metrics
from common.model_store import resolve_model_dir
from common.shutdown import stop_requests
from common.transport.worker_auth import worker_token_interceptors
from services.kvcache.client import KvIndexClient
from services.kvcache.publisher import KvEventPublisher
from services.worker.drain import leave
from services.worker.host.idle_release import IdleRelease
from services.worker.kv_events import add_events, snapshot_source
from services.worker.metrics import WorkerMetrics, engine_labels
from services.worker.server import EngineThread, WorkerService, keep_registered
from services.worker.settings import WorkerSettings
from services.worker.shard_choice import SHARD_LOST_S, Rebalancing, ShardLink, follow_shards
from services.worker.wiring import build_engine, thread_pacer, with_cpu_threads

log = logging.getLogger("worker")


async def serve(settings: WorkerSettings) -> None:
    model_dir = resolve_model_dir(settings.model_name, Path(settings.model_cache_dir))
    # Built on the thread its steps run on (EngineThread: one OpenMP team, not two).
    # With the device's speed-ups (wiring.py): the engine core does not import them.
    engine_thread = await EngineThread.build(partial(build_engine, with_cpu_threads(dataclasses.replace(
        settings.engine, model_dir=str(model_dir)))))
    engine = engine_thread.engine
    pacer = await engine_thread.run(partial(thread_pacer, settings.cpu_thread_policy, engine))
    # Building the grammar tokenizer holds the GIL for seconds on a 262k vocabulary (llguidance
    # does not let go of it): with GRAMMAR_TOKENIZER=start it finishes before the worker registers,
    # so it never stalls a step; by default the first constrained request starts it and the
    # worker's steps wait for it once (as a first structured request does on vLLM).
    if engine.grammars.tokenizer.started and not await asyncio.to_thread(engine.grammars.tokenizer.wait):
        log.warning("structured output unavailable on this worker: its grammar tokenizer did not build")
    labels = engine_labels(engine)
    log.info("engine ready", extra={"model_dir": str(model_dir), "num_blocks": engine.info.num_blocks,
                                    "sliding_blocks": engine.kv_layout.sliding_blocks,
                                    "sliding_window": engine.kv_layout.window, "kv_mb": engine.kv.nbytes() >> 20,
                                    "cpu_compute": engine.config.cpu_compute,
                                    "decode_graphs": engine.graphs is not None, "native_linears": engine.native_linears,
                                    "coded_linears": engine.coded_linears,
                                    "prefill_linear_kernel": engine.prefill_linear_kernel,
                                    "fused_mlps": engine.fused_mlps, "forward": engine.direct_forward,
                                    "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", ""),
                                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
                                    "threads": engine.config.torch_threads,
                                    "thread_policy": "adaptive" if pacer else "fixed", **labels})
    metrics = WorkerMetrics(CollectorRegistry(), settings.worker_id, engine.pool_stats(), labels)
    metrics_port = serve_metrics(settings.metrics_port, metrics.registry, host=settings.host)
    kv_client = KvIndexClient.connect(settings.kvcache_addr, auth=settings.internal)
    publisher = KvEventPublisher(settings.worker_id, kv_client.publish, snapshot_source(engine_thread.snapshot))
    idle = (IdleRelease(settings.idle_release_s, engine.release_host_memory)
            if settings.idle_release_s > 0 and engine.device.type == "cpu" else None)
    service = WorkerService(engine_thread, settings.worker_id, metrics,
                            on_block_events=partial(add_events, publisher),
                            kv_events_unacknowledged=lambda: publisher.unacknowledged,
                            after_step=_after_step(pacer.after_step if pacer else None, idle),
                            before_step=pacer.before_step if pacer else None,
                            quiet_release_s=settings.quiet_release_s)
    server = GrpcServer([(worker_pb2_grpc.add_WorkerServicer_to_server, service)],
                        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
                        settings.host, settings.port, settings.internal)
    await server.start()
    await server.set_serving(True)
    address = f"{settings.advertise_host}:{server.port}"
    log.info("worker serving", extra={"address": address, "metrics_port": metrics_port})

    stops = stop_requests()
    stop = asyncio.Event()
    registration, link = _start_registration(settings, address, service, stop)
    tasks = [registration, asyncio.create_task(publisher.run(settings.kv_publish_interval_s, stop))]
    if idle is not None:
        tasks.append(asyncio.create_task(idle.run(engine_thread.run, stop)))
    await stops.graceful.wait()
    # Leaving: no more heartbeats or registering again (the drain's calls count as
    # heartbeats); Steps are served until the scheduler has taken over.
    registration.cancel()
    if link.channel is not None:
        await leave(link.channel, settings.worker_id, settings.drain_timeout_s, stops.now)
    stop.set()
    log.info("worker stopping")
    await server.stop()
    service.quiet_release.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    engine_thread.shutdown()
    if link.channel is not None:
        await link.channel.close()
    await kv_client.close()


def _after_step(paced: Callable[[int, float], None] | None,
                idle: IdleRelease | None) -> Callable[[int, float], None] | None:
    """What runs on the engine's thread after each step: the thread pacer's measure (`paced`)
    and the idle release's clock, where they serve."""
    if idle is None:
        return paced

    def after_step(decode_rows: int, wall_s: float) -> None:
        if paced is not None:
            paced(decode_rows, wall_s)
        idle.stepped()
    return after_step


def _start_registration(settings: WorkerSettings, address: str, service: WorkerService,
                        stop: asyncio.Event) -> tuple[asyncio.Task[None], ShardLink]:
    """Keeps the worker registered with its scheduler, or with the scheduler shard with the
    fewest workers, choosing again when that one is lost and moving when the shards drift
    apart (shard_choice.py); the link holds the channel its drain will leave through."""
    def connect(scheduler_addr: str) -> grpc.aio.Channel:
        # The only channel that carries the worker token (common/transport/worker_auth.py).
        return internal_channel(scheduler_addr, settings.internal, worker_token_interceptors(settings.worker_token))

    def register(channel: grpc.aio.Channel, lost_after_s: float | None = None) -> Awaitable[None]:
        return keep_registered(channel, settings.worker_id, address, service, settings.heartbeat_interval_s, stop,
                               lost_after_s)

    def leave_for_another(channel: grpc.aio.Channel) -> Awaitable[object]:
        return leave(channel, settings.worker_id, settings.drain_timeout_s, stop)

    link = ShardLink()
    if settings.scheduler_shards:
        return asyncio.create_task(follow_shards(
            settings.scheduler_shards, settings.internal, settings.worker_id, connect,
            partial(register, lost_after_s=SHARD_LOST_S), link, stop,
            Rebalancing(settings.shard_rebalance_s, leave_for_another))), link
    link.channel = connect(settings.scheduler_addr)
    return asyncio.create_task(register(link.channel)), link


def main() -> None:
    settings = WorkerSettings.from_env(os.environ)
    configure_logging("worker", settings.log_level)
    setup_tracing("worker", os.environ)    # off unless OTEL_EXPORTER_OTLP_ENDPOINT is set
    try:
        event_loop.run(serve(settings), settings.event_loop)
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
