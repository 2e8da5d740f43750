"""Scheduler process: `python -m services.scheduler.main`."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from common.logs import configure_logging
from common.metrics import serve_metrics

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
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("scheduler stopping")
    await server.stop()


def main() -> None:
    settings = SchedulerSettings.from_env(os.environ)
    configure_logging("scheduler", settings.log_level)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
