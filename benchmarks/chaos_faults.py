"""The chaos suite's faults: how each target is killed (SIGKILL), started
again and waited for, on a scripts.stack.Stack with two workers; and a
redis-server that can be killed and started again on the same port."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scripts.stack import Stack, free_port

READY_S = 120.0


@dataclass
class Fault:
    name: str
    kill: Callable[[], None]
    restart: Callable[[], None]
    settle: Callable[[], None]        # the stack whole again (both workers) before the next fault


class RedisProcess:
    """redis-server on a fixed free port, nothing persisted; kill() is SIGKILL."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait()
        return self.url

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()

    def _wait(self, timeout_s: float = 10.0) -> None:
        from tests.fixtures.redis_server import wait_for_redis

        wait_for_redis(self.url, self.process, timeout_s)


def faults_for(stack: Stack, redis: RedisProcess | None) -> list[Fault]:
    """A worker, the scheduler and the KV index service; with Redis, Redis only
    (the other faults do not depend on the index's backend)."""
    both_workers = lambda: stack.wait_workers(2, READY_S)  # noqa: E731
    if redis is not None:
        return [Fault("redis", redis.kill, redis.start, both_workers)]
    kvcache_address = f"127.0.0.1:{stack.ports.kvcache}"
    return [
        Fault("worker", lambda: stack.kill("worker-0"), lambda: stack.respawn("worker-0"), both_workers),
        Fault("scheduler", lambda: stack.kill("scheduler"), stack.start_scheduler_again, both_workers),
        Fault("kvcache", lambda: stack.kill("kvcache"),
              lambda: (stack.respawn("kvcache"), stack.wait_serving("kvcache", kvcache_address, READY_S)),
              both_workers),
    ]
