"""Settings of the kvcache index service, read once from the environment.

The Redis password (KV_INDEX_REDIS_PASSWORD, or KV_INDEX_REDIS_PASSWORD_FILE
holding it) is never shown: not by the settings' repr, nor by any error."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from common.transport.internal_auth import InternalAuth
from common.settings.env import SettingsError
from services.kvcache.settings_schema import KvCacheSchema


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
    event_loop: str = "auto"      # EVENT_LOOP (common/event_loop.py)
    internal: InternalAuth = InternalAuth()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "KvCacheSettings":
        values = KvCacheSchema.read(env)
        settings = cls(
            host=values.kvcache_host,
            port=values.kvcache_port,
            metrics_port=values.kvcache_metrics_port,
            backend=values.kv_index_backend,
            redis_url=values.redis_url,
            redis_prefix=values.kv_index_redis_prefix,
            redis_password=read_redis_password(values.kv_index_redis_password,
                                               values.kv_index_redis_password_file),
            redis_socket_timeout_s=values.redis_socket_timeout_s,
            block_size=values.kv_cache_block_size,
            model_key=values.model_key,
            log_level=values.log_level,
            event_loop=values.event_loop,
            internal=InternalAuth.from_env(env),
        )
        if settings.redis_password and urlsplit(settings.redis_url).password:
            raise SettingsError("REDIS_URL holds a password and KV_INDEX_REDIS_PASSWORD(_FILE) "
                                "is set too: give it once")
        return settings


def read_redis_password(inline: str, path: str) -> str:
    """KV_INDEX_REDIS_PASSWORD (`inline`), or the first line of KV_INDEX_REDIS_PASSWORD_FILE
    (`path`, a Secret mounted as a file); "" when neither is set."""
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
