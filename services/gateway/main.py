"""Runs the gateway: the HTTP API (uvicorn) and the gRPC text API in one
asyncio loop. `python -m services.gateway.main`"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from common import event_loop
from common.transport.grpc_server import GrpcServer
from common.observability.logs import configure_logging
from common.observability.tracing import setup_tracing, shutdown_tracing
from common.model_store import resolve_model_dir
from common.shutdown import StopRequests, stop_requests
from services.gateway.app import create_app, create_metrics_app
from services.gateway.drain import Drain
from services.gateway.doors.grpc_api import SERVICE_NAME, TextGenerationServicer
from services.gateway.doors.grpc_api import add_to_server as add_text_api
from services.gateway.doors.grpc_api import public_grpc_limits
from services.gateway.http_limits import uvicorn_limits
from services.gateway.streaming.scheduler_client import SchedulerClient
from services.gateway.streaming.shards import ShardedScheduler
from services.gateway.settings import GatewaySettings
from services.gateway.text.text_tokenizer import TextTokenizer

log = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_S = 5


def load_tokenizer(settings: GatewaySettings) -> TextTokenizer:
    model_dir = resolve_model_dir(settings.model_name, settings.model_cache_dir)
    return TextTokenizer.from_dir(model_dir)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: main() owns the signals and
    stops both servers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def warn_if_internal_ports_open(settings: GatewaySettings) -> None:
    """API keys guard the public API only: without INTERNAL_TOKEN anyone who can
    reach the scheduler, workers or kvcache calls them with any identity."""
    if settings.tenants.enabled and not settings.internal.token:
        log.warning("API keys are set but INTERNAL_TOKEN is not: the internal gRPC ports (scheduler, "
                    "workers, kvcache) take calls from anyone who reaches them, keys or not; set "
                    "INTERNAL_TOKEN (and WORKER_TOKEN on the scheduler and workers)")


def scheduler_backend(settings: GatewaySettings) -> SchedulerClient | ShardedScheduler:
    """The scheduler, or its shards (SCHEDULER_SHARDS)."""
    def client(address: str) -> SchedulerClient:
        return SchedulerClient(address, settings.kvcache_addr, settings.internal,
                               multiplexed=settings.scheduler_stream == "multiplexed")
    if not settings.scheduler_shards:
        return client(settings.scheduler_addr)
    shards = [client(address) for address in settings.scheduler_shards]
    return ShardedScheduler(shards, settings.scheduler_shards, index=shards[0].cached_prefix_tokens)


async def serve(settings: GatewaySettings) -> None:
    warn_if_internal_ports_open(settings)
    tokenizer = await asyncio.to_thread(load_tokenizer, settings)
    backend = scheduler_backend(settings)
    app = create_app(settings, backend, tokenizer)
    grpc_server = GrpcServer(
        [(add_text_api, TextGenerationServicer(app.state.gateway))],
        [SERVICE_NAME], settings.host, settings.grpc_port, **public_grpc_limits(settings))
    http_server = _Server(uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off",
        **uvicorn_limits(settings)))

    metrics_server = metrics_only_server(settings, app)
    drainer = asyncio.create_task(drain_then_exit(stop_requests(), app.state.gateway.drain,
                                                  http_server, settings.drain_timeout_s))
    await grpc_server.start()
    await grpc_server.set_serving(True)
    metrics_task = asyncio.create_task(metrics_server.serve()) if metrics_server else None
    log.info("gateway listening", extra={"http_port": settings.port,
                                         "grpc_port": grpc_server.port,
                                         "metrics_port": settings.metrics_port or settings.port,
                                         "scheduler": ",".join(settings.scheduler_shards)
                                                      or settings.scheduler_addr,
                                         "prefix_cache_scope": settings.cache_scope,
                                         "served_model_names": ",".join(settings.model_names)})
    if settings.tenants.enabled and settings.cache_scope == "global":
        log.warning("PREFIX_CACHE_SCOPE=global with API keys: tenants share cached prefixes, so one "
                    "can read another's prompts through cached_tokens and timings")
    try:
        await http_server.serve()
    finally:
        drainer.cancel()
        if metrics_server is not None and metrics_task is not None:
            metrics_server.should_exit = True
            await metrics_task
        await grpc_server.stop()
        await backend.close()
        log.info("gateway stopped")


def metrics_only_server(settings: GatewaySettings, app: FastAPI) -> uvicorn.Server | None:
    """With METRICS_PORT set, /metrics on that port (same host) and not on
    the public one; None otherwise."""
    if not settings.metrics_port:
        return None
    metrics_app = create_metrics_app(app.state.gateway)
    return _Server(uvicorn.Config(metrics_app, host=settings.host, port=settings.metrics_port,
                                  log_config=None, access_log=False, lifespan="off",
                                  timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))


async def drain_then_exit(stops: StopRequests, drain: Drain, http_server: uvicorn.Server,
                          timeout_s: float) -> None:
    """The first stop signal drains (drain.py): generation requests are refused
    and those in flight (HTTP and gRPC) end, for up to `timeout_s`; then both
    servers stop. A second signal stops at once, without waiting for open streams."""
    await stops.graceful.wait()
    drain.begin()
    log.info("gateway draining", extra={"in_flight": drain.in_flight, "drain_timeout_s": timeout_s})
    idle = await drain.wait_idle(timeout_s, stops.now)
    log.info("gateway drained" if idle else "gateway drain cut short",
             extra={"in_flight": drain.in_flight})
    http_server.should_exit = True
    await stops.now.wait()
    http_server.force_exit = True


def main() -> None:
    settings = GatewaySettings.from_env(os.environ)
    configure_logging("gateway", settings.log_level)
    setup_tracing("gateway", os.environ)    # off unless OTEL_EXPORTER_OTLP_ENDPOINT is set
    try:
        event_loop.run(serve(settings), settings.event_loop)
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
