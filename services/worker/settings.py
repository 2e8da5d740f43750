"""Worker settings, read once from the environment at start."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from common.internal_auth import InternalAuth
from common.lora_paths import AdapterPathError, parse_lora_modules
from common.model_store import default_cache_dir
from common.settings import EnvReader, SettingsError
from common.worker_auth import worker_token_from_env
from services.scheduler.registration import MAX_WORKER_ID_LENGTH
from services.worker.engine.config import EngineConfig
from services.worker.engine.lora.registry import LoraConfig

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")
EVICTION_POLICIES = ("lru", "lfu")                      # services/worker/engine/eviction.py
ATTENTION_BACKENDS = ("auto", "sdpa", "flash_attn", "native")   # services/worker/engine/prefill_kernels.py
CPU_LINEAR_KERNELS = ("auto", "mkl", "onednn")          # services/worker/engine/cpu/cpu_linear.py
LM_HEAD_SCREEN_MODES = ("auto", "on", "off")            # services/worker/engine/cpu/lm_head_screen.py
LM_HEAD_SCREEN_WEIGHTS = ("auto", "copy")               # services/worker/engine/cpu/screen_loader.py
LM_HEAD_SCREEN_ACTIVATIONS = ("auto", "int16", "int8")  # services/worker/engine/cpu/codes_screen_int8.py
DECODE_ATTENTION_MODES = ("auto", "native", "sdpa")     # services/worker/engine/cpu/native_decode.py
CPU_NATIVE_KERNELS_MODES = ("auto", "off")              # services/worker/engine/cpu/native_ops.py
DIRECT_FORWARD_MODES = ("auto", "off")                  # services/worker/engine/cpu/direct_forward.py
CPU_WEIGHT_CODES_MODES = ("auto", "narrow", "8bit", "off")  # services/worker/engine/cpu/weight_codes.py
CPU_COMPUTE_MODES = ("float32", "bfloat16")             # services/worker/engine/cpu/bf16_compute.py
CPU_PREFILL_WEIGHTS_MODES = ("auto", "packs", "codes")  # services/worker/engine/cpu/coded_wide.py
CPU_PREFILL_GEMM_MODES = ("auto", "native", "library")  # services/worker/engine/cpu/prefill_gemm.py
GRAMMAR_TOKENIZER_MODES = ("first_use", "start")         # services/worker/engine/grammar.py


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
    read = EnvReader(env)
    config = EngineConfig(
        model_dir="",
        device=read.choice("DEVICE", "auto", DEVICES),
        dtype=read.choice("DTYPE", "auto", DTYPES),
        block_size=read.int("KV_CACHE_BLOCK_SIZE", 16, minimum=1, maximum=1024),
        num_blocks=read.int("KV_CACHE_NUM_BLOCKS", 0, minimum=0),
        kv_memory_fraction=read.float("KV_CACHE_MEMORY_FRACTION", 0.0, minimum=0.0, maximum=0.95),
        kv_hybrid=read.bool("KV_CACHE_HYBRID", True),
        sliding_blocks=read.int("KV_CACHE_SLIDING_BLOCKS", 0, minimum=0),
        eviction_policy=read.choice("EVICTION_POLICY", "lru", EVICTION_POLICIES),
        enable_prefix_caching=read.bool("ENABLE_PREFIX_CACHING", True),
        prompt_logits_cache_size=read.int("PROMPT_LOGITS_CACHE_SIZE", 32, minimum=0, maximum=100_000),
        max_model_len=read.int("MAX_MODEL_LEN", 0, minimum=0),
        model_key=read.str("MODEL_KEY", ""),
        torch_threads=read.int("TORCH_THREADS", 0, minimum=0),
        use_cuda_graphs=read.bool("USE_CUDA_GRAPHS", True),
        cuda_graph_max_batch=read.int("CUDA_GRAPH_MAX_BATCH", 64, minimum=1, maximum=1024),
        cuda_graph_max_context=read.int("CUDA_GRAPH_MAX_CONTEXT", 8192, minimum=1),
        attention_backend=read.choice("ATTENTION_BACKEND", "auto", ATTENTION_BACKENDS),
        decode_attention=read.choice("DECODE_ATTENTION", "auto", DECODE_ATTENTION_MODES),
        cpu_native_kernels=read.choice("CPU_NATIVE_KERNELS", "auto", CPU_NATIVE_KERNELS_MODES),
        direct_forward=read.choice("DIRECT_FORWARD", "auto", DIRECT_FORWARD_MODES),
        cpu_gemm_cache_entries=read.int("CPU_GEMM_CACHE_ENTRIES", 32, minimum=0, maximum=65536),
        cpu_weight_codes=read.choice("CPU_WEIGHT_CODES", "auto", CPU_WEIGHT_CODES_MODES),
        cpu_linear_kernel=read.choice("CPU_LINEAR_KERNEL", "auto", CPU_LINEAR_KERNELS),
        cpu_compute=read.choice("CPU_COMPUTE", "float32", CPU_COMPUTE_MODES),
        cpu_prefill_weights=read.choice("CPU_PREFILL_WEIGHTS", "auto", CPU_PREFILL_WEIGHTS_MODES),
        cpu_prefill_gemm=read.choice("CPU_PREFILL_GEMM", "auto", CPU_PREFILL_GEMM_MODES),
        lm_head_screen=read.choice("LM_HEAD_SCREEN", "auto", LM_HEAD_SCREEN_MODES),
        lm_head_screen_max_rows=read.int("LM_HEAD_SCREEN_MAX_ROWS", 0, minimum=0, maximum=1024),
        lm_head_screen_weights=read.choice("LM_HEAD_SCREEN_WEIGHTS", "auto", LM_HEAD_SCREEN_WEIGHTS),
        lm_head_screen_activations=read.choice("LM_HEAD_SCREEN_ACTIVATIONS", "auto", LM_HEAD_SCREEN_ACTIVATIONS),
        ngram_min=read.int("SPECULATIVE_NGRAM_MIN", 2, minimum=1, maximum=16),
        ngram_max=read.int("SPECULATIVE_NGRAM_MAX", 4, minimum=1, maximum=16),
        grammar_tokenizer=read.choice("GRAMMAR_TOKENIZER", "first_use", GRAMMAR_TOKENIZER_MODES),
        lora=LoraConfig(modules=_lora_modules(read.str("LORA_MODULES", "")),
                        max_loras=read.int("MAX_LORAS", 4, minimum=1, maximum=1024),
                        max_rank=read.int("MAX_LORA_RANK", 64, minimum=1, maximum=1024),
                        root=read.str("LORA_ROOT", "")),
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
    worker_token: bytes = field(default=b"", repr=False)   # sent to the scheduler (common/worker_auth.py)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "WorkerSettings":
        read = EnvReader(env)
        host = read.str("WORKER_HOST", "127.0.0.1")
        internal = InternalAuth.from_env(env)
        return cls(
            host=host,
            port=read.port("WORKER_PORT", 50061),
            advertise_host=read.str("WORKER_ADVERTISE_HOST", default_advertise_host(host)),
            worker_id=read.str("WORKER_ID", default_worker_id()),
            metrics_port=read.port("WORKER_METRICS_PORT", 9102),
            model_name=read.str("MODEL_NAME", ""),
            model_cache_dir=read.str("MODEL_CACHE_DIR", str(default_cache_dir())),
            scheduler_addr=read.str("SCHEDULER_ADDR", "127.0.0.1:50051"),
            kvcache_addr=read.str("KVCACHE_ADDR", "127.0.0.1:50071"),
            heartbeat_interval_s=read.float("WORKER_HEARTBEAT_INTERVAL_S", 2.0, minimum=0.1),
            kv_publish_interval_s=read.float("KV_PUBLISH_INTERVAL_S", 0.05, minimum=0.001),
            log_level=read.str("LOG_LEVEL", "info"),
            engine=engine_config_from_env(env),
            internal=internal,
            drain_timeout_s=read.float("DRAIN_TIMEOUT_S", 30.0, minimum=0.0),
            worker_token=worker_token_from_env(env, internal.token),
        )
