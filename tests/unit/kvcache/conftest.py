"""Fixtures: a real redis-server on a free port, in a temp dir."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Starts redis-server on a free port for the session; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found: install it (apt-get install -y redis-server) "
                    "to run the Redis backend tests")
    workdir = tmp_path_factory.mktemp("redis")
    port = _free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_for_redis(url, process)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_for_redis(url: str, process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {process.returncode}")
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        client.close()


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """The session's Redis, emptied before each test."""
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    yield redis_server

