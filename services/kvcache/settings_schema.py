"""The kvcache service's settings.

One field per environment variable (the name in capitals): its type, default, bounds and meaning.
`KvCacheSettings` builds the running settings from it; `fairserve kvcache --help`, `fairserve config`
and docs/config.md are generated from it (common/settings/schema.py).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from common.observability.logs import LOG_LEVELS

from common.settings.shared import EventLoopFields, InternalAuthFields, ModelKeyFields


class KvCacheSchema(InternalAuthFields, ModelKeyFields, EventLoopFields):
    service: ClassVar[str] = "kvcache"
    advanced: ClassVar[frozenset[str]] = frozenset({
        "event_loop",
    })
    secrets: ClassVar[frozenset[str]] = InternalAuthFields.secrets | {"kv_index_redis_password"}
    kv_index_redis_password: str = Field('',
        description=(
            'Redis password (AUTH), a secret never logged; not with a password in `REDIS_URL`'
        ))
    kv_index_redis_password_file: str = Field('',
        description=(
            'read the Redis password from the first line of this file instead (`deploy/` does)'
        ))
    kvcache_host: str = Field('127.0.0.1',
        description=(
            "the kvcache index's gRPC listen address"
        ))
    kvcache_port: int = Field(50071, ge=0, le=65535,
        description=(
            "the kvcache index's gRPC port (scheduler and workers dial it)"
        ))
    kvcache_metrics_port: int = Field(9103, ge=0, le=65535,
        description=(
            'Prometheus `/metrics` (0 picks a free port)'
        ))
    kv_index_backend: Literal['memory', 'redis'] = Field('memory',
        description=(
            '`memory` or `redis`'
        ))
    redis_url: str = Field('redis://127.0.0.1:6379/0',
        description=(
            'Redis for the shared index'
        ))
    kv_index_redis_prefix: str = Field('fairserve:kv:',
        description=(
            'the prefix of every Redis key the index writes, so several stacks can share one Redis'
        ))
    redis_socket_timeout_s: float = Field(0.5, ge=0.001,
        description=(
            'deadline of each connect to Redis and each reply: a Redis that is down or does not '
            'answer fails the call (a dropped connection is retried once, a timeout never), then '
            'index calls fail at once for 1 s, so lookups answer `UNAVAILABLE` fast and the scheduler'
            ' routes by load'
        ))
    kv_cache_block_size: int = Field(16, ge=1, le=4096,
        description=(
            'tokens per KV block'
        ))
    log_level: Literal[(*LOG_LEVELS, 'critical')] = Field('info',
        description=(
            'JSON logs on stderr'
        ))
