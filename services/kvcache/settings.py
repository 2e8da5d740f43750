"""Settings of the kvcache index service, read once from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from common.internal_auth import InternalAuth
from common.settings import EnvReader

BACKENDS = ("memory", "redis")


@dataclass(frozen=True)
class KvCacheSettings:
    host: str = "127.0.0.1"
    port: int = 50071
    metrics_port: int = 9103
    backend: str = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "fairserve:kv:"
    redis_socket_timeout_s: float = 0.5
    block_size: int = 16
    model_key: str = ""
    log_level: str = "info"
    internal: InternalAuth = InternalAuth()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "KvCacheSettings":
        read = EnvReader(env)
        return cls(
            host=read.str("KVCACHE_HOST", cls.host),
            port=read.port("KVCACHE_PORT", cls.port),
            metrics_port=read.port("KVCACHE_METRICS_PORT", cls.metrics_port),
            backend=read.choice("KV_INDEX_BACKEND", cls.backend, BACKENDS),
            redis_url=read.str("REDIS_URL", cls.redis_url),
            redis_prefix=read.str("KV_INDEX_REDIS_PREFIX", cls.redis_prefix),
            redis_socket_timeout_s=read.float("REDIS_SOCKET_TIMEOUT_S", cls.redis_socket_timeout_s,
                                              minimum=0.001),
            block_size=read.int("KV_CACHE_BLOCK_SIZE", cls.block_size, minimum=1, maximum=4096),
            model_key=read.str("MODEL_KEY", cls.model_key),
            log_level=read.choice("LOG_LEVEL", cls.log_level,
                                  ("debug", "info", "warning", "error", "critical")),
            internal=InternalAuth.from_env(env),
        )
