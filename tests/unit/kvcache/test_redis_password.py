"""The Redis-backed index against a Redis that requires a password
(`requirepass`, as deploy/ runs it): it connects with KV_INDEX_REDIS_PASSWORD
and is refused without it, and the password never reaches the logs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.kvcache.main import build_backend
from services.kvcache.stores.redis_backend import RedisBackend
from services.kvcache.settings import KvCacheSettings
from tests.fixtures.redis_server import running_redis

PASSWORD = "pw-redis-0123456789abcdef"


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_redis(tmp_path_factory.mktemp("redis-auth"), password=PASSWORD) as url:
        yield url


async def test_the_index_connects_with_the_password_from_a_file(locked_redis: str,
                                                                tmp_path: Path) -> None:
    secret = tmp_path / "redis_password"
    secret.write_text(PASSWORD + "\n")
    settings = KvCacheSettings.from_env({"KV_INDEX_BACKEND": "redis", "REDIS_URL": locked_redis,
                                         "KV_INDEX_REDIS_PASSWORD_FILE": str(secret)})
    backend = await build_backend(settings)
    try:
        await backend.wait_ready(2.0)
        assert (await backend.stats()).nodes == 0
    finally:
        await backend.close()


async def test_without_the_password_redis_refuses_and_nothing_leaks(
        locked_redis: str, caplog: pytest.LogCaptureFixture) -> None:
    for password in ("", "pw-wrong-guess-000"):
        backend = RedisBackend.from_url(locked_redis, 16, password=password)
        caplog.set_level(logging.DEBUG)
        try:
            with pytest.raises(ConnectionError):
                await backend.wait_ready(0.3, interval_s=0.1)
        finally:
            await backend.close()
    assert PASSWORD not in caplog.text and "pw-wrong-guess" not in caplog.text
