"""Which settings schema each command reads, and how to start each service.

Importing a schema is light (no torch, no model): `--help` and `config` never load the engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from common.settings.schema import SettingsSchema
from fairserve.launcher.settings_schema import RunSchema
from services.gateway.settings_schema import GatewaySchema
from services.kvcache.settings_schema import KvCacheSchema
from services.scheduler.settings_schema import SchedulerSchema
from services.worker.settings_schema import WorkerSchema

# In the order a request walks, as `run` starts them the other way round.
SERVICES: dict[str, type[SettingsSchema]] = {
    "gateway": GatewaySchema,
    "scheduler": SchedulerSchema,
    "worker": WorkerSchema,
    "kvcache": KvCacheSchema,
}
RUN: type[SettingsSchema] = RunSchema

SUMMARIES = {
    "run": "the whole stack on this machine: kvcache, scheduler, one worker and the gateway",
    "gateway": "the HTTP (OpenAI-compatible) and gRPC front door",
    "scheduler": "continuous batching, fairness and routing over the workers",
    "worker": "the model and its paged KV cache",
    "kvcache": "the index of cached prefixes across workers",
}


def schemas_for(command: str) -> list[type[SettingsSchema]]:
    """The schemas whose settings `command` takes: one service's, or for `run` its own and every
    service's (the launcher passes them on to the services it starts)."""
    if command == "run":
        return [RUN, *SERVICES.values()]
    return [SERVICES[command]]


# What a service's process sets before its module loads (the worker's: before torch loads).
PROCESS_START = {"worker": "services.worker.host.process_start"}


def entry_point(command: str) -> Callable[[], object]:
    """The function that runs `command` (imported only then: the worker's pulls in torch),
    its process prepared first where it has a `PROCESS_START`."""
    if command in PROCESS_START:
        importlib.import_module(PROCESS_START[command]).prepare_process()
    module = {"run": "fairserve.launcher.run_stack"}.get(command, f"services.{command}.main")
    return importlib.import_module(module).main
