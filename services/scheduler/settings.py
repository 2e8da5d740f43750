"""Scheduler settings, read once from the environment at start."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from common.settings.env import address_list
from common.transport.internal_auth import InternalAuth
from common.step import KvPolicy

from services.scheduler.settings_schema import SchedulerSchema
from common.transport.worker_auth import worker_token_from_env

from services.scheduler.core.types import CoreConfig, Policy, PrefillMode



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
    peers: tuple[str, ...] = ()     # SCHEDULER_PEERS (peer_exchange.py)
    peer_exchange_s: float = 0.1
    worker_heartbeat_timeout_s: float = _CORE.heartbeat_timeout_s
    vtc_input_weight: float = _CORE.vtc_input_weight
    vtc_output_weight: float = _CORE.vtc_output_weight
    prefix_wait_min_tokens: int = _CORE.prefix_wait_min_tokens
    routing_load_slack: int = _CORE.routing_load_slack
    async_scheduling: bool = True
    # One or two greedy streams verify n-gram drafts by default: the same tokens, fewer forwards
    # where the text repeats itself (docs/benchmarks.md, "Speculative decoding").
    speculative_tokens: int = 4
    speculative_max_batch: int = 2
    speculative_sampled: bool = False
    decode_steps: int = 4           # core/allowances/decode_steps.py: runs a decode may take in one step
    decode_step_ms: float = 160.0   # ... more of them while they fit in this (quick runs)
    prefill_decode_steps: int = 1   # ... in a step that also prefills
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
    event_loop: str = "auto"      # EVENT_LOOP (common/event_loop.py)
    internal: InternalAuth = InternalAuth()
    worker_token: bytes = field(default=b"", repr=False)  # common/transport/worker_auth.py; empty: none required
    registration_address_check: str = "peer"              # address_check.py: peer | off

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SchedulerSettings:
        values = SchedulerSchema.read(env)
        internal = InternalAuth.from_env(env)
        return cls(
            host=values.scheduler_host,
            port=values.scheduler_port,
            metrics_port=values.scheduler_metrics_port,
            policy=Policy(values.scheduling_policy),
            max_batch_size=values.max_batch_size,
            max_batch_tokens=values.max_batch_tokens,
            max_active_kv_tokens=values.max_active_kv_tokens,
            prefill_chunk_size=values.prefill_chunk_size,
            prefill_mode=PrefillMode(values.prefill_mode),
            max_queue_len=values.max_queue_len,
            queue_timeout_s=values.queue_timeout_s,
            kvcache_addr=values.kvcache_addr,
            peers=address_list("SCHEDULER_PEERS", values.scheduler_peers),
            peer_exchange_s=values.peer_exchange_s,
            worker_heartbeat_timeout_s=values.worker_heartbeat_timeout_s,
            vtc_input_weight=values.vtc_input_weight,
            vtc_output_weight=values.vtc_output_weight,
            prefix_wait_min_tokens=values.prefix_wait_min_tokens,
            routing_load_slack=values.routing_load_slack,
            async_scheduling=values.async_scheduling,
            speculative_tokens=values.speculative_tokens,
            speculative_max_batch=values.speculative_max_batch,
            speculative_sampled=values.speculative_sampled,
            decode_steps=values.decode_steps,
            decode_step_ms=values.decode_step_ms,
            prefill_decode_steps=values.prefill_decode_steps,
            max_migrations=values.max_migrations,
            worker_recovery_s=values.worker_recovery_s,
            detached_ttl_s=values.detached_ttl_s,
            step_timeout_s=values.step_timeout_s,
            step_transport=values.step_transport,
            kv_policy=values.kv_policy,
            kv_budget_tokens=values.kv_budget_tokens,
            kv_sink_tokens=values.kv_sink_tokens,
            max_tokens_limit=values.max_tokens_limit,
            log_level=values.log_level,
            event_loop=values.event_loop,
            internal=internal,
            worker_token=worker_token_from_env(env, internal.token),
            registration_address_check=values.registration_address_check,
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
            routing_load_slack=self.routing_load_slack,
            max_steps_in_flight=2 if self.async_scheduling else 1,
            speculative_tokens=self.speculative_tokens, speculative_max_batch=self.speculative_max_batch,
            speculative_sampled=self.speculative_sampled, decode_steps=self.decode_steps,
            decode_step_ms=self.decode_step_ms,
            prefill_decode_steps=self.prefill_decode_steps,   # the planner caps it at decode_steps
            max_migrations=self.max_migrations,
            worker_recovery_s=self.worker_recovery_s,
            kv_policy=KvPolicy(self.kv_policy, self.kv_budget_tokens, self.kv_sink_tokens),
            max_tokens_limit=self.max_tokens_limit,
        )

    @property
    def heartbeat_interval_s(self) -> float:
        """What workers are told: three heartbeats fit in one timeout."""
        return self.worker_heartbeat_timeout_s / 3.0

