"""What the gateway needs from the services behind it, as plain values.

The gRPC client (scheduler_client.py) implements SchedulerBackend; tests
inject a fake with the same methods. Nothing here imports grpc.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.types import SamplingParams, TokenLogprob, Usage
from services.gateway.tenancy.tenants import TenantLimits


@dataclass(frozen=True)
class GenerationSpec:
    """A checked request, ready for the scheduler (built by spec.build_spec).
    max_tokens is the completion budget: at least 1, and within the context
    with the prompt whenever the context length is known."""
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # stop strings: the gateway matches them, the scheduler never sees them
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    client_id: str = "anonymous"  # the fairness client: the tenant's name with API keys
    session_id: str = ""
    priority: int = 0
    user: str = ""                # the end user within the client (with API keys)
    weight: float = 1.0           # the client's VTC weight
    cache_salt: str = ""          # prefix-cache scope: "" shares cached blocks with everyone
    # A continuation (continuation.py): tokens already streamed for this request
    # before its scheduler was lost; max_tokens and min_tokens count them.
    resume_token_ids: tuple[int, ...] = ()
    # What its KV keeps past the deployment's budget (full | window | sink | h2o); "": KV_POLICY.
    # A lossy one is not held to the model's context.
    kv_policy: str = ""
    # With API keys: the authenticated tenant's limits, which the scheduler holds for
    # every gateway (TENANTS_FILE); None: no keys, an unauthenticated request.
    tenant_limits: TenantLimits | None = None
    # A submission of work a scheduler admitted before (continuation.py): not refused
    # or charged again by the tenant's limits.
    resubmitted: bool = False
    # A request that outlives its call (a background /v1/responses response): leaving the
    # stream does not cancel it, and the scheduler keeps its events and `attachment`.
    detached: bool = False
    attachment: bytes = b""
    # Not a new request: re-reads the detached request of this id from its first event.
    attach: bool = False
    # The LoRA adapter serving it (lora_catalog.py; "": the base model): its name, where workers
    # that do not know it load it from, its weights' digest. cache_salt carries it too.
    lora_name: str = ""
    lora_path: str = ""
    lora_digest: str = ""
    # The kvcache index's answer, (worker id, cached prefix tokens) pairs, when the gateway asked
    # it to pick a scheduler shard (streaming/shards.py): the scheduler uses it instead of asking
    # again. None: not asked.
    index_answer: tuple[tuple[str, int], ...] | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What the workers serve, as the scheduler reports it; None while unknown
    (no worker has registered yet)."""
    max_model_len: int | None = None
    vocab_size: int | None = None
    default_kv_policy: str = "full"     # the scheduler's KV_POLICY

    @property
    def known(self) -> bool:
        return self.max_model_len is not None and self.vocab_size is not None


@dataclass(frozen=True)
class TokenOutput:
    token_id: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    usage: Usage
    message: str = ""
    queue_wait_s: float | None = None  # arrival to admission at the scheduler, if known


@dataclass(frozen=True)
class GenerationEvent:
    tokens: tuple[TokenOutput, ...] = ()
    finish: Finish | None = None
    # With the first tokens, when sampling.prompt_logprobs: the prompt's tokens' logprobs,
    # from the second token on (the first has none).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    address: str
    healthy: bool


@dataclass(frozen=True)
class SchedulerView:
    workers: tuple[WorkerView, ...]
    details: dict[str, Any] = field(default_factory=dict)
    # Requests waiting for a worker to register while none serves (WORKER_RECOVERY_S).
    waiting_for_worker: int = 0
    worker_wait_s: float = 0.0
    worker_recovery_s: float = 0.0

    @property
    def healthy_workers(self) -> int:
        return sum(1 for worker in self.workers if worker.healthy)

    def not_ready_reason(self) -> str:
        """Why the gateway is not ready for want of a worker, with what waits for one."""
        reason = "no healthy worker is registered with the scheduler"
        if self.waiting_for_worker:
            reason += (f"; {self.waiting_for_worker} request(s) wait for one to register, the longest "
                       f"for {self.worker_wait_s:.0f} s (WORKER_RECOVERY_S={self.worker_recovery_s:g})")
        return reason


@dataclass(frozen=True)
class Readiness:
    """Ready when the scheduler answers with a healthy worker. `dependencies`
    says which services answered the probe; one down while ready (the kvcache
    index: routing does without it) leaves the gateway serving, degraded."""
    ready: bool
    reason: str = ""
    dependencies: tuple[tuple[str, bool], ...] = ()   # (service, answered)

    @property
    def degraded(self) -> tuple[str, ...]:
        """The services that did not answer."""
        return tuple(name for name, up in self.dependencies if not up)


class BackendError(Exception):
    """The scheduler refused or failed a request."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message


class Overloaded(BackendError):
    """The admission queue is full, or a tenant is at a limit (HTTP 429)."""

    def __init__(self, message: str = "", retry_after_s: int = 1, code: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.code = code


class InvalidGeneration(BackendError):
    """The request can never be served as asked (HTTP 400)."""


class Unavailable(BackendError):
    """No worker, the scheduler is unreachable, or a hold timed out (HTTP 503)."""

    def __init__(self, message: str = "", retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SchedulerLost(Unavailable):
    """The connection to the scheduler failed (it is down, restarting or out of
    reach), as opposed to the scheduler refusing the request: worth resubmitting."""


class SchedulerBackend(Protocol):
    # The scheduler has answered since start: a failed connection to it later is a
    # lost scheduler, which requests wait for (continuation.py); before, a 503 at once.
    scheduler_seen: bool

    def generate(self, spec: GenerationSpec, request_id: str,
                 trace_id: str = "") -> AsyncIterator[GenerationEvent]:
        """Streams the request's events; raises a BackendError on rejection.
        Closing the iterator early cancels the request. request_id is the
        scheduler's (unique); trace_id, the client's, goes along for the logs."""
        ...

    async def cancel(self, request_id: str) -> bool: ...

    async def detached(self, request_id: str, client_id: str) -> GenerationSpec | None:
        """A detached request as it was sent, for its client; None when unknown."""
        ...

    async def scheduler_stats(self) -> SchedulerView: ...

    async def kvcache_stats(self) -> dict[str, Any]: ...

    async def readiness(self) -> Readiness: ...

    async def model_info(self) -> ModelInfo:
        """What the workers serve, as far as the scheduler knows yet."""
        ...

    async def close(self) -> None: ...
