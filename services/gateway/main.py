"""Runs the gateway: the HTTP API (uvicorn) and the gRPC text API in one
asyncio loop. `python -m services.gateway.main`"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import uvicorn

from common.grpc_server import GrpcServer
from common.logs import configure_logging
from common.model_store import resolve_model_dir
from common.shutdown import on_stop_signal
from services.gateway.app import create_app
from services.gateway.grpc_api import SERVICE_NAME, TextGenerationServicer
from services.gateway.grpc_api import add_to_server as add_text_api
from services.gateway.http_limits import uvicorn_limits
from services.gateway.scheduler_client import SchedulerClient
from services.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_S = 5


def load_tokenizer(settings: GatewaySettings) -> Any:
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(settings.model_name, settings.model_cache_dir)
    return AutoTokenizer.from_pretrained(str(model_dir))


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
        [SERVICE_NAME], settings.host, settings.grpc_port,
        max_receive_bytes=settings.grpc_max_message_bytes)
    http_server = _Server(uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off",
        **uvicorn_limits(settings)))

    def request_exit() -> None:
        # A second signal stops at once, without waiting for open streams.
        http_server.force_exit = http_server.should_exit
        http_server.should_exit = True

    on_stop_signal(request_exit)

    await grpc_server.start()
    await grpc_server.set_serving(True)
    log.info("gateway listening", extra={"http_port": settings.port,
                                         "grpc_port": grpc_server.port,
                                         "scheduler": settings.scheduler_addr})
    try:
        await http_server.serve()
    finally:
        await grpc_server.stop()
        await backend.close()
        log.info("gateway stopped")


def main() -> None:
    settings = GatewaySettings.from_env(os.environ)
    configure_logging("gateway", settings.log_level)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
