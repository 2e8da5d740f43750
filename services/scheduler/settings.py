"""Scheduler settings, read once from the environment at start."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from common.internal_auth import InternalAuth
from common.step import KV_POLICIES, KvPolicy

from common.settings import EnvReader
from common.worker_auth import worker_token_from_env

from services.scheduler.address_check import ADDRESS_CHECKS
from services.scheduler.core.types import CoreConfig, Policy, PrefillMode

STEP_TRANSPORTS = ("stream", "unary")   # services/scheduler/step_link.py


_CORE = CoreConfig()    # the scheduling defaults live with the core


@dataclass(frozen=True)
class SchedulerSettings:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9101
    policy: Policy = _CORE.policy
    max_batch_size: int = _CORE.max_batch_size
    max_batch_tokens: int = _CORE.max_batch_tokens
    max_active_kv_tokens: int = _CORE.max_active_kv_tokens
    prefill_chunk_size: int = _CORE.prefill_chunk_size
    prefill_mode: PrefillMode = _CORE.prefill_mode
    max_queue_len: int = _CORE.max_queue_len
    queue_timeout_s: float = _CORE.queue_timeout_s
    kvcache_addr: str = "127.0.0.1:50071"
    worker_heartbeat_timeout_s: float = _CORE.heartbeat_timeout_s
    vtc_input_weight: float = _CORE.vtc_input_weight
    vtc_output_weight: float = _CORE.vtc_output_weight
    prefix_wait_min_tokens: int = _CORE.prefix_wait_min_tokens
    async_scheduling: bool = True
    # One or two greedy streams verify n-gram drafts by default: the same tokens, fewer forwards
    # where the text repeats itself (docs/benchmarks.md, "Speculative decoding").
    speculative_tokens: int = 4
    speculative_max_batch: int = 2
    speculative_sampled: bool = False
    max_migrations: int = _CORE.max_migrations
    worker_recovery_s: float = _CORE.worker_recovery_s   # core/recovery.py
    detached_ttl_s: float = 3600.0   # detached.py: how long an ended detached request is kept
    step_timeout_s: float = 60.0    # a step's deadline; 0: none
    step_transport: str = "stream"  # step_link.py: one StepStream call per worker, or a Step call each
    kv_policy: str = "full"
    kv_budget_tokens: int = 1024
    kv_sink_tokens: int = 4
    max_tokens_limit: int = _CORE.max_tokens_limit   # 0: each worker's context length
    log_level: str = "info"
    internal: InternalAuth = InternalAuth()
    worker_token: bytes = field(default=b"", repr=False)  # common/worker_auth.py; empty: none required
    registration_address_check: str = "peer"              # address_check.py: peer | off

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SchedulerSettings:
        read = EnvReader(env)
        internal = InternalAuth.from_env(env)
        return cls(
            host=read.str("SCHEDULER_HOST", cls.host),
            port=read.port("SCHEDULER_PORT", cls.port),
            metrics_port=read.port("SCHEDULER_METRICS_PORT", cls.metrics_port),
            policy=Policy(read.choice("SCHEDULING_POLICY", cls.policy.value, [p.value for p in Policy])),
            max_batch_size=read.int("MAX_BATCH_SIZE", cls.max_batch_size, minimum=1),
            max_batch_tokens=read.int("MAX_BATCH_TOKENS", cls.max_batch_tokens, minimum=1),
            max_active_kv_tokens=read.int("MAX_ACTIVE_KV_TOKENS", cls.max_active_kv_tokens, minimum=1),
            prefill_chunk_size=read.int("PREFILL_CHUNK_SIZE", cls.prefill_chunk_size, minimum=1),
            prefill_mode=PrefillMode(read.choice("PREFILL_MODE", cls.prefill_mode.value,
                                                 [m.value for m in PrefillMode])),
            max_queue_len=read.int("MAX_QUEUE_LEN", cls.max_queue_len, minimum=1),
            queue_timeout_s=read.float("QUEUE_TIMEOUT_S", cls.queue_timeout_s, minimum=0.001),
            kvcache_addr=read.str("KVCACHE_ADDR", cls.kvcache_addr),
            worker_heartbeat_timeout_s=read.float("WORKER_HEARTBEAT_TIMEOUT_S",
                                                  cls.worker_heartbeat_timeout_s, minimum=0.001),
            vtc_input_weight=read.float("VTC_INPUT_WEIGHT", cls.vtc_input_weight, minimum=0.0),
            vtc_output_weight=read.float("VTC_OUTPUT_WEIGHT", cls.vtc_output_weight, minimum=0.0),
            prefix_wait_min_tokens=read.int("PREFIX_WAIT_MIN_TOKENS", cls.prefix_wait_min_tokens, minimum=0),
            async_scheduling=read.bool("ASYNC_SCHEDULING", cls.async_scheduling),
            speculative_tokens=read.int("SPECULATIVE_TOKENS", cls.speculative_tokens, minimum=0, maximum=64),
            speculative_max_batch=read.int("SPECULATIVE_MAX_BATCH", cls.speculative_max_batch, minimum=0),
            speculative_sampled=read.bool("SPECULATIVE_SAMPLED", cls.speculative_sampled),
            max_migrations=read.int("MAX_MIGRATIONS", cls.max_migrations, minimum=0),
            worker_recovery_s=read.float("WORKER_RECOVERY_S", cls.worker_recovery_s, minimum=0.0),
            detached_ttl_s=read.float("DETACHED_TTL_S", cls.detached_ttl_s, minimum=1.0),
            step_timeout_s=read.float("STEP_TIMEOUT_S", cls.step_timeout_s, minimum=0.0),
            step_transport=read.choice("STEP_TRANSPORT", cls.step_transport, list(STEP_TRANSPORTS)),
            kv_policy=read.choice("KV_POLICY", cls.kv_policy, list(KV_POLICIES)),
            kv_budget_tokens=read.int("KV_BUDGET_TOKENS", cls.kv_budget_tokens, minimum=1),
            kv_sink_tokens=read.int("KV_SINK_TOKENS", cls.kv_sink_tokens, minimum=0),
            max_tokens_limit=read.int("MAX_TOKENS_LIMIT", cls.max_tokens_limit, minimum=0),
            log_level=read.choice("LOG_LEVEL", cls.log_level, ["debug", "info", "warning", "error"]),
            internal=internal,
            worker_token=worker_token_from_env(env, internal.token),
            registration_address_check=read.choice("REGISTRATION_ADDRESS_CHECK", cls.registration_address_check,
                                                   list(ADDRESS_CHECKS)),
        )

    def core_config(self) -> CoreConfig:
        return CoreConfig(
            policy=self.policy, max_batch_size=self.max_batch_size,
            max_batch_tokens=self.max_batch_tokens, max_active_kv_tokens=self.max_active_kv_tokens,
            prefill_chunk_size=self.prefill_chunk_size, prefill_mode=self.prefill_mode,
            max_queue_len=self.max_queue_len, queue_timeout_s=self.queue_timeout_s,
            heartbeat_timeout_s=self.worker_heartbeat_timeout_s,
            vtc_input_weight=self.vtc_input_weight, vtc_output_weight=self.vtc_output_weight,
            prefix_wait_min_tokens=self.prefix_wait_min_tokens,
            max_steps_in_flight=2 if self.async_scheduling else 1,
            speculative_tokens=self.speculative_tokens, speculative_max_batch=self.speculative_max_batch,
            speculative_sampled=self.speculative_sampled,
            max_migrations=self.max_migrations,
            worker_recovery_s=self.worker_recovery_s,
            kv_policy=KvPolicy(self.kv_policy, self.kv_budget_tokens, self.kv_sink_tokens),
            max_tokens_limit=self.max_tokens_limit,
        )

    @property
    def heartbeat_interval_s(self) -> float:
        """What workers are told: three heartbeats fit in one timeout."""
        return self.worker_heartbeat_timeout_s / 3.0
