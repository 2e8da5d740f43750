"""Plain values exchanged between the scheduling core and its transport."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from common.step import KvPolicy
from common.types import SamplingParams, TokenLogprob, Usage


class Policy(StrEnum):
    FCFS = "fcfs"
    VTC = "vtc"
    # The VTC once a waiting or running request carries an authenticated tenant (the
    # gateway has API keys), FCFS otherwise: fair by default wherever there are tenants.
    AUTO = "auto"


class PrefillMode(StrEnum):
    MIXED = "mixed"              # prefill chunks ride in the same forward as decodes
    ALTERNATING = "alternating"  # a prefill step, then a decode step


class Gate(StrEnum):
    """Where a request was stopped. The first six reject, the last two hold."""

    QUEUE = "queue"
    QUOTA = "quota"          # its tenant is at one of its limits (core/quotas.py)
    NEVER_FIT = "never_fit"
    TIMEOUT = "timeout"
    NO_WORKER = "no_worker"
    INVALID = "invalid"
    ACTIVE_KV = "active_kv"
    CACHE_POOL = "cache_pool"


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class CoreConfig:
    policy: Policy = Policy.AUTO
    max_batch_size: int = 32
    max_batch_tokens: int = 2048
    max_active_kv_tokens: int = 262144
    prefill_chunk_size: int = 512
    prefill_mode: PrefillMode = PrefillMode.MIXED
    max_queue_len: int = 1024
    queue_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 10.0
    vtc_input_weight: float = 1.0
    vtc_output_weight: float = 2.0
    # A fresh request sharing at least this many prompt tokens with one being
    # prefilled goes to that request's worker and waits for the shared blocks
    # (prefix_share.py); 0 turns it off.
    prefix_wait_min_tokens: int = 64
    # Cache affinity gives way to load (routing.py, `balanced`): a worker holding a request's
    # prefix is passed over once it has more than this many requests above the least loaded
    # worker and over BALANCE_RATIO times its load; 0: half of max_batch_size.
    routing_load_slack: int = 0
    # Steps a worker may have in flight: 2 plans the next step while the worker
    # computes the current one (async scheduling), 1 waits for each result.
    max_steps_in_flight: int = 1
    # Speculative decoding: each decode may verify up to this many n-gram draft
    # tokens the worker proposes (0 turns it off) while at most
    # speculative_max_batch requests decode on the worker (0: any number);
    # sampled requests (temperature > 0) get drafts only with speculative_sampled.
    speculative_tokens: int = 0
    speculative_max_batch: int = 0
    speculative_sampled: bool = True
    # Multi-step decoding (allowances/decode_steps.py): while nothing waits on a worker (no request queued
    # or prefilling there), each decode may run up to this many times in one step; 1: off.
    decode_steps: int = 1
    # Quick runs: a step may take more runs than decode_steps, as many as fit in this many ms
    # by the worker's last decode-only step's time a run, scaled up with the batch's decodes
    # (allowances/decode_steps.py, quick_runs); 0: off.
    decode_step_ms: float = 0.0
    # The runs a step that also prefills may take (its new sequences decoding on): 1 keeps a new
    # request's first token with its prefill's step.
    prefill_decode_steps: int = 1
    # A request running on a worker that fails moves to another at most this
    # many times, then ends with an error (a request that crashes workers).
    max_migrations: int = 2
    # What a request's KV keeps past a budget when it names no kv_policy (KV_POLICY, with
    # KV_BUDGET_TOKENS and KV_SINK_TOKENS; common/step.py's KvPolicy).
    kv_policy: KvPolicy = KvPolicy()
    # The most max_tokens a request may ask for under any KV policy (MAX_TOKENS_LIMIT);
    # 0: the worker's context length. Above it a request is refused, never clamped.
    max_tokens_limit: int = 0
    # While no worker serves, running and queued requests (and new ones, within the gates)
    # wait this long for one to register, then end with an error (WORKER_RECOVERY_S);
    # 0: they end at once. Only once a worker has registered (recovery.py).
    worker_recovery_s: float = 60.0


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # <= 0: as many as the context allows
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    client_id: str = ""      # fairness identity: the tenant with API keys, else session / user
    session_id: str = ""
    priority: int = 0
    user: str = ""           # within client_id: the end user splitting the client's share
    weight: float = 1.0      # the client's VTC weight
    cache_salt: str = ""     # prompts with other salts never share cached blocks
    # A continuation (its first scheduler was lost): tokens already generated and
    # streamed. It starts as a request preempted after them; max_tokens and
    # min_tokens count them.
    resume_token_ids: tuple[int, ...] = ()
    kv_policy: str = ""      # full | window | sink | h2o; "": the deployment's KV_POLICY
    authenticated: bool = False         # client_id is a tenant the gateway authenticated
    quota: TenantQuota | None = None    # the tenant's limits (core/quotas.py); None: none
    # Work a scheduler admitted before, sent again after the gateway lost its scheduler:
    # never refused by its tenant's limits, its prompt and resumed tokens not charged again.
    resubmitted: bool = False
    # The LoRA adapter serving it ("": the base model), where a worker that does not know the
    # name loads it from, and its weights' digest. cache_salt carries the adapter too.
    lora_name: str = ""
    lora_path: str = ""
    lora_digest: str = ""


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's limits, as its gateway sends them with each request; None: no limit."""
    max_in_flight: int | None = None    # generations waiting or running at once
    max_queued: int | None = None       # generations without a first token yet
    requests_per_s: float | None = None  # new generations a second, up to `burst` at once
    burst: int | None = None            # None: ceil(requests_per_s)
    tokens_per_minute: int | None = None  # prompt plus output tokens a minute
    max_request_s: float | None = None  # from arrival: past it the request ends with "length"


@dataclass(frozen=True)
class QuotaUsage:
    """One tenant's hold on its quota at one scheduler, as scheduler shards exchange it
    (fairness/peer_quotas.py)."""
    tenant: str
    quota: TenantQuota      # the tenant's limits, as its latest request there carried them
    in_flight: int
    queued: int
    admitted: int           # requests charged to its rate budget there, cumulative
    charged_tokens: int     # tokens charged to its token budget there, cumulative


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    address: str
    block_size: int
    num_blocks: int
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    epoch: int = 0           # this registration's: every step planned for the worker carries it


# One step, scheduler -> worker -> scheduler: common/step.py's contract, shared with the worker.


# ---- what the clients see ----

@dataclass(frozen=True)
class Finish:
    reason: FinishReason
    usage: Usage
    message: str = ""
    queue_wait_s: float | None = None  # None: never admitted


@dataclass(frozen=True)
class Rejection:
    gate: Gate
    message: str
    retry_after_s: int = 0   # Gate.QUOTA: when the tenant's limit may let it in; 0: not said


@dataclass(frozen=True)
class RequestUpdate:
    """Something for one request's stream: tokens, then at most one finish;
    or a rejection before anything was streamed."""

    request_id: str
    tokens: tuple[int, ...] = ()      # output token ids
    # Each token's logprob, aligned with `tokens`; empty when none of them has one (plain ids:
    # nothing is made per token served).
    logprobs: tuple[TokenLogprob | None, ...] = ()
    finish: Finish | None = None
    rejection: Rejection | None = None
    # With the first tokens of a request with sampling.prompt_logprobs: the logprobs
    # of its prompt tokens from the second on (the first has none).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class SubmitResult:
    request_id: str
    worker_id: str | None = None
    rejection: Rejection | None = None

    @property
    def accepted(self) -> bool:
        return self.rejection is None


@dataclass(frozen=True)
class ExpireOutcome:
    updates: tuple[RequestUpdate, ...] = ()
    removed_workers: tuple[str, ...] = ()


# ---- statistics ----

@dataclass(frozen=True)
class WorkerSummary:
    worker_id: str
    address: str
    healthy: bool
    running: int
    pending: int
    free_blocks: int
    cached_blocks: int
    total_blocks: int
    last_step_ms: float
    last_batch_size: int
    steps: int
    reserved_kv_tokens: int
    used_blocks: int = 0
    evictions: int = 0


@dataclass(frozen=True)
class ClientCounter:
    client_id: str
    counter: float          # weighted tokens over the client's weight
    served_tokens: int
    weight: float = 1.0
    charged: float = 0.0    # cumulative, this scheduler's own requests only (peer_counters.py)


@dataclass(frozen=True)
class CoreStats:
    policy: Policy
    pending: int
    prefilling: int
    active: int
    admitted: int
    finished: int
    preemptions: int
    migrations: int = 0             # running requests resumed on another worker after theirs failed
    rejections: dict[str, int] = field(default_factory=dict)
    holds: dict[str, int] = field(default_factory=dict)
    routed: dict[str, int] = field(default_factory=dict)    # requests placed, by why that worker
    workers: tuple[WorkerSummary, ...] = ()
    clients: tuple[ClientCounter, ...] = ()
    reserved_kv_tokens: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    # Requests waiting for a worker to register while none serves (recovery.py), and
    # how long the longest of them has waited.
    waiting_for_worker: int = 0
    worker_wait_s: float = 0.0
    worker_recovery_s: float = 0.0
    quotas: tuple[QuotaUsage, ...] = ()   # every tenant with a quota here (for the other shards)
