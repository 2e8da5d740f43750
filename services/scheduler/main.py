"""Scheduler process: `python -m services.scheduler.main`."""

from __future__ import annotations

import asyncio
import logging
import os

from common import event_loop
from common.observability.logs import configure_logging
from common.observability.tracing import setup_tracing, shutdown_tracing
from common.observability.metrics import serve_metrics
from common.shutdown import on_stop_signal

from services.scheduler.server import SchedulerServer
from services.scheduler.settings import SchedulerSettings

log = logging.getLogger("scheduler")


async def serve(settings: SchedulerSettings) -> None:
    server = SchedulerServer(settings)
    await server.start()
    metrics_port = serve_metrics(settings.metrics_port, server.metrics.registry, host=settings.host)
    log.info("scheduler serving", extra={"port": server.port, "metrics_port": metrics_port,
                                         "policy": settings.policy.value,
                                         "prefill_mode": settings.prefill_mode.value})
    stop = asyncio.Event()
    on_stop_signal(stop.set)
    await stop.wait()
    log.info("scheduler stopping")
    await server.stop()


def main() -> None:
    settings = SchedulerSettings.from_env(os.environ)
    configure_logging("scheduler", settings.log_level)
    setup_tracing("scheduler", os.environ)    # off unless OTEL_EXPORTER_OTLP_ENDPOINT is set
    try:
        event_loop.run(serve(settings), settings.event_loop)
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
