"""Worker settings, read once from the environment at start."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from common.transport.internal_auth import InternalAuth
from common.model_files.lora_paths import AdapterPathError, parse_lora_modules
from common.model_store import default_cache_dir
from common.settings.env import SettingsError, address_list
from services.worker.settings_schema import WorkerSchema
from common.transport.worker_auth import worker_token_from_env
from common.worker_ids import MAX_WORKER_ID_LENGTH
from services.worker.engine.config import EngineConfig
from services.worker.engine.lora.registry import LoraConfig



def default_advertise_host(bind_host: str) -> str:
    """The address the scheduler should dial: the bind address, or this
    host's own address when bound to every interface (as in a container)."""
    if bind_host not in ("0.0.0.0", "::"):
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def default_worker_id() -> str:
    """A worker id unique per host and process: `worker-<hostname>-<pid>`, in the
    scheduler's charset (letters, digits, '.', '_', '-'; at most 128 characters).
    The hostname matters in containers, where every replica's worker is PID 1."""
    host = re.sub(r"[^A-Za-z0-9._-]+", "-", socket.gethostname()).strip("-._") or "host"
    suffix = f"-{os.getpid()}"
    return "worker-" + host[:MAX_WORKER_ID_LENGTH - len("worker-") - len(suffix)] + suffix


def engine_config_from_env(env: Mapping[str, str]) -> EngineConfig:
    """The engine's settings from their variables. The model directory is left empty:
    the worker resolves it from MODEL_NAME at start (dataclasses.replace)."""
    values = WorkerSchema.read(env)
    config = EngineConfig(
        model_dir="",
        device=values.device,
        dtype=values.dtype,
        block_size=values.kv_cache_block_size,
        num_blocks=values.kv_cache_num_blocks,
        kv_memory_fraction=values.kv_cache_memory_fraction,
        kv_hybrid=values.kv_cache_hybrid,
        sliding_blocks=values.kv_cache_sliding_blocks,
        eviction_policy=values.eviction_policy,
        enable_prefix_caching=values.enable_prefix_caching,
        prompt_logits_cache_size=values.prompt_logits_cache_size,
        max_model_len=values.max_model_len,
        model_key=values.model_key,
        torch_threads=values.torch_threads,
        use_cuda_graphs=values.use_cuda_graphs,
        cuda_graph_max_batch=values.cuda_graph_max_batch,
        cuda_graph_max_context=values.cuda_graph_max_context,
        attention_backend=values.attention_backend,
        decode_attention=values.decode_attention,
        cpu_native_kernels=values.cpu_native_kernels,
        direct_forward=values.direct_forward,
        model_impl=values.model_impl,
        cpu_gemm_cache_entries=values.cpu_gemm_cache_entries,
        host_memory_release_rows=values.host_memory_release_rows,
        cpu_weight_codes=values.cpu_weight_codes,
        cpu_linear_kernel=values.cpu_linear_kernel,
        cpu_compute=values.cpu_compute,
        cpu_prefill_weights=values.cpu_prefill_weights,
        cpu_prefill_gemm=values.cpu_prefill_gemm,
        lm_head_screen=values.lm_head_screen,
        lm_head_screen_max_rows=values.lm_head_screen_max_rows,
        lm_head_screen_weights=values.lm_head_screen_weights,
        lm_head_screen_activations=values.lm_head_screen_activations,
        lm_head_screen_plane=values.lm_head_screen_plane,
        ngram_min=values.speculative_ngram_min,
        ngram_max=values.speculative_ngram_max,
        grammar_tokenizer=values.grammar_tokenizer,
        lora=LoraConfig(modules=_lora_modules(values.lora_modules),
                        max_loras=values.max_loras,
                        max_rank=values.max_lora_rank,
                        root=values.lora_root),
    )
    if config.ngram_min > config.ngram_max:
        raise SettingsError(f"SPECULATIVE_NGRAM_MIN={config.ngram_min} is invalid: "
                            f"must be at most SPECULATIVE_NGRAM_MAX={config.ngram_max}")
    return config


def _lora_modules(value: str) -> dict[str, str]:
    try:
        return parse_lora_modules(value)
    except AdapterPathError as error:
        raise SettingsError(str(error)) from None


@dataclass(frozen=True)
class WorkerSettings:
    host: str
    port: int
    advertise_host: str
    worker_id: str
    metrics_port: int
    model_name: str
    model_cache_dir: str
    scheduler_addr: str
    kvcache_addr: str
    heartbeat_interval_s: float
    kv_publish_interval_s: float
    log_level: str
    engine: EngineConfig           # model_dir still empty: resolved at start
    internal: InternalAuth = InternalAuth()
    drain_timeout_s: float = 30.0  # on SIGTERM, how long it may keep serving what it holds
    worker_token: bytes = field(default=b"", repr=False)   # sent to the scheduler (common/transport/worker_auth.py)
    cpu_thread_policy: str = "adaptive"   # engine/cpu/thread_governor.py
    idle_release_s: float = 5.0           # HOST_MEMORY_IDLE_RELEASE_S (idle_release.py); 0: never
    quiet_release_s: float = 1.0          # HOST_MEMORY_QUIET_RELEASE_S (host/quiet_release.py); 0: right after the step
    event_loop: str = "auto"              # EVENT_LOOP (common/event_loop.py)
    scheduler_shards: tuple[str, ...] = ()   # SCHEDULER_SHARDS (shard_choice.py); (): scheduler_addr
    shard_rebalance_s: float = 30.0          # SCHEDULER_SHARD_REBALANCE_S (shard_choice.py); 0: off

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "WorkerSettings":
        values = WorkerSchema.read(env)
        host = values.worker_host
        internal = InternalAuth.from_env(env)
        return cls(
            host=host,
            port=values.worker_port,
            advertise_host=(values.worker_advertise_host or default_advertise_host(host)),
            worker_id=values.worker_id or default_worker_id(),
            metrics_port=values.worker_metrics_port,
            model_name=values.model_name,
            model_cache_dir=values.model_cache_dir or str(default_cache_dir()),
            scheduler_addr=values.scheduler_addr,
            kvcache_addr=values.kvcache_addr,
            heartbeat_interval_s=values.worker_heartbeat_interval_s,
            kv_publish_interval_s=values.kv_publish_interval_s,
            log_level=values.log_level,
            event_loop=values.event_loop,
            engine=engine_config_from_env(env),
            internal=internal,
            drain_timeout_s=values.drain_timeout_s,
            scheduler_shards=address_list("SCHEDULER_SHARDS", values.scheduler_shards),
            shard_rebalance_s=values.scheduler_shard_rebalance_s,
            worker_token=worker_token_from_env(env, internal.token),
            cpu_thread_policy=values.cpu_thread_policy,
            idle_release_s=values.host_memory_idle_release_s,
            quiet_release_s=values.host_memory_quiet_release_s,
        )
