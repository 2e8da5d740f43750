"""Runs the gateway: the HTTP API (uvicorn) and the gRPC text API in one
asyncio loop. `python -m services.gateway.main`"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator

import uvicorn

from common.grpc_server import GrpcServer
from common.logs import configure_logging
from common.model_store import resolve_model_dir
from common.shutdown import StopRequests, stop_requests
from services.gateway.app import create_app
from services.gateway.drain import Drain
from services.gateway.grpc_api import SERVICE_NAME, TextGenerationServicer
from services.gateway.grpc_api import add_to_server as add_text_api
from services.gateway.grpc_api import public_grpc_limits
from services.gateway.http_limits import uvicorn_limits
from services.gateway.scheduler_client import SchedulerClient
from services.gateway.settings import GatewaySettings
from services.gateway.text_tokenizer import TextTokenizer

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


async def serve(settings: GatewaySettings) -> None:
    tokenizer = await asyncio.to_thread(load_tokenizer, settings)
    backend = SchedulerClient(settings.scheduler_addr, settings.kvcache_addr, settings.internal)
    app = create_app(settings, backend, tokenizer)
    grpc_server = GrpcServer(
        [(add_text_api, TextGenerationServicer(app.state.gateway))],
        [SERVICE_NAME], settings.host, settings.grpc_port, **public_grpc_limits(settings))
    http_server = _Server(uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off",
        **uvicorn_limits(settings)))

    drainer = asyncio.create_task(drain_then_exit(stop_requests(), app.state.gateway.drain,
                                                  http_server, settings.drain_timeout_s))
    await grpc_server.start()
    await grpc_server.set_serving(True)
    log.info("gateway listening", extra={"http_port": settings.port,
                                         "grpc_port": grpc_server.port,
                                         "scheduler": settings.scheduler_addr})
    try:
        await http_server.serve()
    finally:
        drainer.cancel()
        await grpc_server.stop()
        await backend.close()
        log.info("gateway stopped")


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
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
