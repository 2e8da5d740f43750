"""The scheduler's settings.

One field per environment variable (the name in capitals): its type, default, bounds and meaning.
`SchedulerSettings` builds the running settings from it; `fairserve scheduler --help`, `fairserve config`
and docs/config.md are generated from it (common/settings/schema.py).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from common.observability.logs import LOG_LEVELS
from common.step import KV_POLICIES
from services.scheduler.workers.address_check import ADDRESS_CHECKS
from services.scheduler.core.types import Policy, PrefillMode
from services.scheduler.workers.step_link import STEP_TRANSPORTS

from common.settings.shared import (
    InternalAuthFields, WorkerTokenFields, TracingFields, KvcacheAddrFields,
    MaxTokensLimitFields, EventLoopFields,
)


class SchedulerSchema(
        InternalAuthFields, WorkerTokenFields, TracingFields, KvcacheAddrFields,
        MaxTokensLimitFields, EventLoopFields,
):
    service: ClassVar[str] = "scheduler"
    advanced: ClassVar[frozenset[str]] = frozenset({
        "event_loop",
        "async_scheduling",
        "step_transport",
        "speculative_tokens",
        "speculative_max_batch",
        "speculative_sampled",
        "decode_steps",
        "decode_step_ms",
        "prefill_decode_steps",
        "prefix_wait_min_tokens",
        "routing_load_slack",
        "vtc_input_weight",
        "vtc_output_weight",
        "prefill_mode",
        "peer_exchange_s",
    })
    secrets: ClassVar[frozenset[str]] = InternalAuthFields.secrets | WorkerTokenFields.secrets
    scheduler_host: str = Field('127.0.0.1',
        description=(
            "the scheduler's gRPC listen address"
        ))
    scheduler_port: int = Field(50051, ge=0, le=65535,
        description=(
            "the scheduler's gRPC port (gateways and workers dial it)"
        ))
    scheduler_peers: str = Field('',
        description=(
            'the other scheduler shards, comma-separated `host:port`: each shard serves its own '
            'workers, and every `PEER_EXCHANGE_S` adds its peers\' service to each tenant\'s '
            'fairness counter, so a tenant served on several shards is ordered by its service on all '
            'of them (docs/scaling.md). Empty: one scheduler'
        ))
    peer_exchange_s: float = Field(0.1, gt=0.0,
        description=(
            'how often a shard reads its `SCHEDULER_PEERS` counters'
        ))
    scheduler_metrics_port: int = Field(9101, ge=0, le=65535,
        description=(
            'Prometheus `/metrics` (0 picks a free port)'
        ))
    max_batch_size: int = Field(32, ge=1,
        description=(
            'sequences per forward'
        ))
    max_batch_tokens: int = Field(2048, ge=1,
        description=(
            'tokens per forward'
        ))
    max_active_kv_tokens: int = Field(262144, ge=1,
        description=(
            'prompt + max_tokens reserved by active requests'
        ))
    prefill_chunk_size: int = Field(512, ge=1,
        description=(
            'longest prefill chunk per step'
        ))
    max_queue_len: int = Field(1024, ge=1,
        description=(
            'waiting requests before 429'
        ))
    queue_timeout_s: float = Field(60.0, ge=0.001,
        description=(
            'soft hold before 503'
        ))
    worker_heartbeat_timeout_s: float = Field(10.0, ge=0.001,
        description=(
            'silence before a worker leaves the rotation'
        ))
    vtc_input_weight: float = Field(1.0, ge=0.0,
        description=(
            'what VTC charges a client per prompt token'
        ))
    vtc_output_weight: float = Field(2.0, ge=0.0,
        description=(
            'what VTC charges a client per output token'
        ))
    prefix_wait_min_tokens: int = Field(64, ge=0,
        description=(
            'a new request sharing at least this many prompt tokens with one being prefilled goes to '
            "that request's worker and waits until the shared blocks are computed, then skips them "
            '(`n` > 1 choices, bursts over one system prompt); `0` disables'
        ))
    routing_load_slack: int = Field(0, ge=0,
        description=(
            'cache-aware routing gives way to load: a worker holding the longest cached prefix of '
            'a prompt is passed over for the least loaded once it holds more than this many '
            'requests above that one and over 1.5x its load (a tenant whose prompts share a '
            'system prompt spreads over the workers instead of queueing on one); `0`: half of '
            '`MAX_BATCH_SIZE`'
        ))
    async_scheduling: bool = Field(True,
        description=(
            "plan and send each worker's next step while its current one runs, so the worker never "
            'waits for a scheduling round trip; a request that stops on EOS computes one token that '
            'is thrown away'
        ))
    speculative_tokens: int = Field(4, ge=0, le=64,
        description=(
            'n-gram speculative decoding: each decode may verify up to this many draft tokens that '
            "the worker copies from earlier in the sequence (prompt lookup), all in the decode's "
            'forward; the text is unchanged (greedy exactly, seeded draw for draw). By default only '
            'greedy requests draft, while at most two decode on a worker (the two rows below): on W1 '
            "one stream's TPOT went from ~17 to 9-11 ms and two streams' tokens/s up 15-18 %, while "
            'at 4 streams drafts were even and at 8 they lost (`docs/benchmarks.md`, "Speculative '
            'decoding"); 0 turns it off'
        ))
    speculative_max_batch: int = Field(2, ge=0,
        description=(
            'no drafts while more requests than this decode on a worker (every draft row is computed '
            'whether kept or not, and with several streams those rows cost more than the kept tokens '
            'save); 0: no limit'
        ))
    speculative_sampled: bool = Field(False,
        description=(
            'whether sampled requests (temperature > 0) get drafts too; a draw at a temperature keeps'
            ' far fewer copied tokens than greedy decoding'
        ))
    decode_steps: int = Field(4, ge=1, le=64,
        description=(
            'multi-step decoding: while no request waits on a worker that a step could take (queued '
            'with a batch slot for it, or prefilling there), each decode may run up to this many '
            'times in one step, the worker running them back to back, so the scheduling round trip '
            '(planning, the reply, the streams\' messages) is '
            'paid once per that many tokens; a request arriving there ends the runs at the next '
            'one. One stream\'s TPOT on W1 ~9.5 -> ~8.2 ms on 2 cores (`docs/benchmarks.md`). Tokens '
            'reach the clients in bursts of a run\'s worth, and a request cancelled or ending on a '
            'stop string may compute up to that many runs that are thrown away; 1: off'
        ))
    decode_step_ms: float = Field(160.0, ge=0, le=10_000,
        description=(
            'multi-step decoding for quick runs (a few streams on a CPU): a step may take more runs '
            'than `DECODE_STEPS`, as many as fit in this many ms by the worker\'s last decode-only '
            'step\'s time a run (scaled up with the batch\'s decodes; at most 64), under the same '
            'conditions as `DECODE_STEPS`, and the worker ends the runs at this budget where a load '
            'slows them. One stream\'s TPOT on W1 3-8 % lower on 2 cores (`docs/benchmarks.md`); '
            'tokens reach a stream in bursts of up to this many ms; 0: off'
        ))
    prefill_decode_steps: int = Field(1, ge=1, le=64,
        description=(
            'multi-step decoding in a step that also prefills (its admissions or prompt chunks): '
            'the runs its decodes may take, the new sequences decoding on from the token their '
            'prefill samples (at most `DECODE_STEPS`). 1 (the default): such a step runs once, so a '
            'new request\'s first token comes with its prefill. More: fewer, fuller steps where '
            'requests keep arriving on busy workers (less scheduler CPU a token; '
            '`docs/scaling.md`), each new request\'s first token waiting out the runs'
        ))
    max_migrations: int = Field(2, ge=0,
        description=(
            'a request running on a worker that fails is resumed on another at most this many times; '
            'at the next failure it ends with an error (a request that crashes every worker it runs '
            'on); moves of a draining worker do not count; `0`: never moved'
        ))
    worker_recovery_s: float = Field(60.0, ge=0.0,
        description=(
            'while no worker is left (after one has registered), running and queued requests, and new'
            ' ones within the gates, wait this long for a worker to register, then resume by '
            'recompute as on failover; past it they end with an error naming the setting; `/ready` '
            'says how many wait; `0`: they end at once'
        ))
    detached_ttl_s: float = Field(3600.0, ge=1.0,
        description=(
            'how long the scheduler keeps an ended background `/v1/responses` request (its tokens and'
            " the gateway's state of it) for a gateway to resume"
        ))
    step_timeout_s: float = Field(60.0, ge=0.0,
        description=(
            "a step's deadline, counted from when it is sent (with `ASYNC_SCHEDULING` that includes "
            'the step it runs after): past it the worker is taken as failed, leaves the rotation and '
            'its requests move to the other workers; `0`: no deadline'
        ))
    step_transport: Literal[STEP_TRANSPORTS] = Field('stream',
        description=(
            'how the scheduler sends a worker its steps: `stream`, every step over one long-lived '
            '`StepStream` call (a message each way per step, about half the CPU of a call on both '
            'sides); `unary`, a `Step` call each'
        ))
    kv_policy: Literal[KV_POLICIES] = Field('full',
        description=(
            "what a request's KV cache keeps once it holds `KV_BUDGET_TOKENS`, when the request names"
            " no `kv_policy` (an extra body field, the gRPC text API's `TextRequest.kv_policy`, and "
            "`GenerateRequest.kv_policy`): `full` everything (bounded by the model's context and the "
            'pool), `window` the most recent tokens, `sink` the first `KV_SINK_TOKENS` plus the most '
            'recent (StreamingLLM), `h2o` the most recent half of the budget plus the blocks with the'
            ' most accumulated attention; lossy policies are block granular, give positions within '
            "the cache so a sequence runs past the model's context and the pool, and share no cached "
            "prefix (`docs/engine.md`); the gateway lets a request's prompt and output past the "
            "model's context when its policy (its own `kv_policy`, else `KV_POLICY`, which the "
            'scheduler reports with the model) is lossy, while `max_tokens` stays within '
            '`MAX_TOKENS_LIMIT`'
        ))
    kv_budget_tokens: int = Field(1024, ge=1,
        description=(
            'tokens a lossy policy keeps per sequence, rounded up to whole blocks (at least the sinks'
            ' and two more blocks)'
        ))
    kv_sink_tokens: int = Field(4, ge=0,
        description=(
            'the attention sinks `sink` keeps, rounded up to whole blocks'
        ))
    log_level: Literal[LOG_LEVELS] = Field('info',
        description=(
            'JSON logs on stderr'
        ))
    registration_address_check: Literal[ADDRESS_CHECKS] = Field('peer',
        description=(
            '`peer`: a worker registers only an address of the host it calls from (names are '
            "resolved; both on the scheduler's host also matches) and a live worker id never moves to"
            ' another address (`PERMISSION_DENIED`, `ALREADY_EXISTS`); `off` for workers behind NAT '
            'or a proxy (docs/deploy.md)'
        ))
    scheduling_policy: Literal[tuple(Policy)] = Field('auto',
        description=(
            '`fcfs`, `vtc`, or `auto`: `vtc` once a request on the worker carries a tenant the '
            'gateway authenticated (`API_KEYS` set; `GenerateRequest.authenticated`), `fcfs` '
            'otherwise, so keys alone make the scheduling fair in compose and Kubernetes too (one '
            "tenant's `n: 8` long generations no longer hold up another's short request)"
        ))
    prefill_mode: Literal[tuple(PrefillMode)] = Field('mixed',
        description=(
            '`mixed` (chunks ride with decodes) or `alternating`'
        ))
