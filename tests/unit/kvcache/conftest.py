"""Fixtures: a real redis-server on a free port, in a temp dir."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.redis_server import flush, running_redis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Starts redis-server on a free port for the session; yields its URL."""
    with running_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """The session's Redis, emptied before each test."""
    flush(redis_server)
    yield redis_server
