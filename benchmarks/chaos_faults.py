"""The chaos suite's faults: how each target is killed (SIGKILL), started
again and waited for, on a fairserve.launcher.stack.Stack with one or two workers (with
one, a fault's name says so); and a redis-server that can be killed and
started again on the same port."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fairserve.launcher.stack import Stack, free_port

READY_S = 120.0


@dataclass
class Fault:
    name: str
    kill: Callable[[], None]
    restart: Callable[[], None]
    settle: Callable[[], None]        # the stack whole again (every worker) before the next fault
    resumes: bool = False             # the client's own gateway dies: its streams resume (chaos_responses.py)


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


def cascade(stack: Stack, gap_s: float) -> None:
    """The scheduler, `gap_s` later worker-0, `gap_s` later the KV index service, each
    killed and started again at once (as `make run`'s supervisor does)."""
    kvcache_address = f"127.0.0.1:{stack.ports.kvcache}"
    steps = (("scheduler", stack.start_scheduler_again), ("worker-0", lambda: stack.respawn("worker-0")),
             ("kvcache", lambda: (stack.respawn("kvcache"),
                                  stack.wait_serving("kvcache", kvcache_address, READY_S))))
    for index, (name, restart) in enumerate(steps):
        if index:
            time.sleep(gap_s)
        stack.kill(name)
        restart()


def faults_for(stack: Stack, redis: RedisProcess | None, workers: int = 2,
               cascade_gap_s: float = 4.0) -> list[Fault]:
    """A worker, the scheduler and the KV index service; with Redis, Redis only
    (the other faults do not depend on the index's backend)."""
    all_workers = lambda: stack.wait_workers(workers, READY_S)  # noqa: E731
    suffix = "" if workers == 2 else f" ({workers} worker{'s' if workers > 1 else ''})"
    if redis is not None:
        return [Fault("redis" + suffix, redis.kill, redis.start, all_workers)]
    kvcache_address = f"127.0.0.1:{stack.ports.kvcache}"
    return [
        Fault("worker" + suffix, lambda: stack.kill("worker-0"), lambda: stack.respawn("worker-0"), all_workers),
        Fault("scheduler" + suffix, lambda: stack.kill("scheduler"), stack.start_scheduler_again, all_workers),
        Fault("kvcache" + suffix, lambda: stack.kill("kvcache"),
              lambda: (stack.respawn("kvcache"), stack.wait_serving("kvcache", kvcache_address, READY_S)),
              all_workers),
        Fault("gateway" + suffix, lambda: stack.kill("gateway"),
              lambda: (stack.respawn("gateway"), stack.wait_ready(READY_S)), all_workers, resumes=True),
        # issue 42's sequence: every service but the gateway, one after another.
        Fault("cascade" + suffix, lambda: cascade(stack, cascade_gap_s), lambda: None, all_workers),
    ]
