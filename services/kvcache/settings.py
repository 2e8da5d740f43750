"""Settings of the kvcache index service, read once from the environment.

The Redis password (KV_INDEX_REDIS_PASSWORD, or KV_INDEX_REDIS_PASSWORD_FILE
holding it) is never shown: not by the settings' repr, nor by any error."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from common.internal_auth import InternalAuth
from common.settings import EnvReader, SettingsError

BACKENDS = ("memory", "redis")


@dataclass(frozen=True)
class KvCacheSettings:
    host: str = "127.0.0.1"
    port: int = 50071
    metrics_port: int = 9103
    backend: str = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "fairserve:kv:"
    redis_password: str = field(default="", repr=False)   # "": the URL's, if any
    redis_socket_timeout_s: float = 0.5
    block_size: int = 16
    model_key: str = ""
    log_level: str = "info"
    internal: InternalAuth = InternalAuth()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "KvCacheSettings":
        read = EnvReader(env)
        settings = cls(
            host=read.str("KVCACHE_HOST", cls.host),
            port=read.port("KVCACHE_PORT", cls.port),
            metrics_port=read.port("KVCACHE_METRICS_PORT", cls.metrics_port),
            backend=read.choice("KV_INDEX_BACKEND", cls.backend, BACKENDS),
            redis_url=read.str("REDIS_URL", cls.redis_url),
            redis_prefix=read.str("KV_INDEX_REDIS_PREFIX", cls.redis_prefix),
            redis_password=read_redis_password(read),
            redis_socket_timeout_s=read.float("REDIS_SOCKET_TIMEOUT_S", cls.redis_socket_timeout_s,
                                              minimum=0.001),
            block_size=read.int("KV_CACHE_BLOCK_SIZE", cls.block_size, minimum=1, maximum=4096),
            model_key=read.str("MODEL_KEY", cls.model_key),
            log_level=read.choice("LOG_LEVEL", cls.log_level,
                                  ("debug", "info", "warning", "error", "critical")),
            internal=InternalAuth.from_env(env),
        )
        if settings.redis_password and urlsplit(settings.redis_url).password:
            raise SettingsError("REDIS_URL holds a password and KV_INDEX_REDIS_PASSWORD(_FILE) "
                                "is set too: give it once")
        return settings


def read_redis_password(read: EnvReader) -> str:
    """KV_INDEX_REDIS_PASSWORD, or the first line of KV_INDEX_REDIS_PASSWORD_FILE
    (a Secret mounted as a file); "" when neither is set."""
    inline = read.str("KV_INDEX_REDIS_PASSWORD", "")
    path = read.str("KV_INDEX_REDIS_PASSWORD_FILE", "")
    if inline and path:
        raise SettingsError("KV_INDEX_REDIS_PASSWORD and KV_INDEX_REDIS_PASSWORD_FILE are both "
                            "set: use one")
    if not path:
        return inline
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8"
        raise SettingsError(f"KV_INDEX_REDIS_PASSWORD_FILE={path!r} is invalid: cannot read it "
                            f"({reason})") from None
    password = text.strip()
    if not password or "\n" in password:
        raise SettingsError(f"KV_INDEX_REDIS_PASSWORD_FILE={path!r} is invalid: it must hold "
                            "one non-empty line")
    return password
