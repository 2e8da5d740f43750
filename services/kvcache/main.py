"""Runs the kvcache index service: `python -m services.kvcache.main`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from prometheus_client import CollectorRegistry

from common import event_loop
from common.observability.logs import configure_logging
from common.observability.metrics import serve_metrics
from common.shutdown import on_stop_signal
from services.kvcache.stores.backend import IndexBackend, MemoryBackend
from services.kvcache.metrics import KvCacheMetrics
from services.kvcache.stores.redis_backend import RedisBackend
from services.kvcache.server import build_server
from services.kvcache.service import KvIndexService
from services.kvcache.settings import KvCacheSettings

log = logging.getLogger("services.kvcache")

METRICS_REFRESH_S = 2.0
REDIS_WAIT_S = 30.0


async def build_backend(settings: KvCacheSettings) -> IndexBackend:
    if settings.backend == "redis":
        backend = RedisBackend.from_url(settings.redis_url, settings.block_size,
                                        settings.redis_prefix, settings.redis_socket_timeout_s,
                                        settings.redis_password)
        try:
            await backend.wait_ready(REDIS_WAIT_S)
        except BaseException:
            await backend.close()
            raise
        return backend
    return MemoryBackend(settings.block_size)


async def refresh_metrics(service: KvIndexService, interval_s: float) -> None:
    while True:
        try:
            await service.stats()
        except Exception as error:  # gauges go stale; the RPCs report the failure
            log.warning("refreshing index metrics failed", extra={"error": str(error)})
        await asyncio.sleep(interval_s)


async def run(settings: KvCacheSettings, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    backend = await build_backend(settings)
    registry = CollectorRegistry()
    service = KvIndexService(backend, settings.model_key, KvCacheMetrics(registry))
    metrics_port = serve_metrics(settings.metrics_port, registry, settings.host)
    server = build_server(service, settings.host, settings.port, settings.internal)
    await server.start()
    await server.set_serving(True)
    log.info("kvcache serving", extra={
        "port": server.port, "metrics_port": metrics_port, "backend": backend.name,
        "block_size": settings.block_size})
    on_stop_signal(stop.set)
    refresher = asyncio.create_task(refresh_metrics(service, METRICS_REFRESH_S))
    try:
        await stop.wait()
    finally:
        log.info("kvcache stopping")
        refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresher
        await server.stop()
        await service.close()


def main() -> None:
    settings = KvCacheSettings.from_env(os.environ)
    configure_logging("kvcache", settings.log_level)
    event_loop.run(run(settings), settings.event_loop)


if __name__ == "__main__":
    main()
