"""Pure scheduling core: no gRPC, no protobuf; clock and ids are injected."""

from services.scheduler.core.scheduler import SchedulerCore
from services.scheduler.core.types import (
    CoreConfig, CoreStats, ExpireOutcome, Finish, FinishReason, Gate, NewSequence, Policy,
    PoolStats, PrefillMode, Rejection, RequestSpec, RequestUpdate, SeqResult, StepBatch,
    StepError, StepOutput, SubmitResult, TokenOut, WorkerSpec, WorkItem,
)

__all__ = [
    "CoreConfig", "CoreStats", "ExpireOutcome", "Finish", "FinishReason", "Gate", "NewSequence",
    "Policy", "PoolStats", "PrefillMode", "Rejection", "RequestSpec", "RequestUpdate",
    "SchedulerCore", "SeqResult", "StepBatch", "StepError", "StepOutput", "SubmitResult", "TokenOut",
    "WorkItem", "WorkerSpec",
]
