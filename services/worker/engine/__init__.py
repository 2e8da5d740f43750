"""The worker's inference engine: paged KV pool, packed batches, sampling.

A pure library (no gRPC, no protobuf) so it can be tested and benchmarked on
its own; services/worker/server.py puts the transport on top of it.

The core (the step: sequences, planning, the forward, sampling, the KV pool) is
at this level; the device speed-ups are apart, in cpu/ and cuda/, which import the
core and never the reverse: they are plugged in from outside (accelerators.py states
how; services/worker/wiring.py plugs them in for the worker, its tests and benchmarks).
"""

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.types import (
    BlockEvent,
    EngineInfo,
    NewSequence,
    PoolStats,
    SeqResult,
    StepBatch,
    StepOutput,
    WorkItem,
)

__all__ = [
    "BlockEvent", "Engine", "EngineConfig", "EngineInfo", "NewSequence", "PoolStats",
    "SeqResult", "StepBatch", "StepOutput", "WorkItem",
]
