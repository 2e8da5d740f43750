"""Starts the four services as separate processes on localhost and waits
until the gateway is ready. Used by `make run` and by the integration tests."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fairserve.launcher.stub_sources import stale_stubs

if TYPE_CHECKING:
    from common.transport.internal_auth import InternalAuth

ROOT = Path(__file__).resolve().parents[2]   # the source checkout's root (tests and benchmarks read it)
# Held only by the scheduler and the workers (common/transport/worker_auth.py): never passed to the others.
WORKER_ONLY = ("WORKER_TOKEN", "WORKER_TOKEN_FILE")
WORKER_ROLE_MODULES = ("services.scheduler.main", "services.worker.main")


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that are free now. All are bound at once: ports probed one
    after another can repeat, and two services handed one port collide."""
    with ExitStack() as sockets:
        bound = [sockets.enter_context(socket.socket()) for _ in range(count)]
        for sock in bound:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in bound]


def free_port() -> int:
    return free_ports(1)[0]


@dataclass
class StackPorts:
    gateway: int = 8000
    gateway_grpc: int = 50050
    scheduler: int = 50051
    scheduler_metrics: int = 9101
    kvcache: int = 50071
    kvcache_metrics: int = 9103
    workers: list[tuple[int, int]] = field(default_factory=lambda: [(50061, 9102)])

    @classmethod
    def free(cls, num_workers: int = 1) -> "StackPorts":
        gateway, gateway_grpc, scheduler, scheduler_metrics, kvcache, kvcache_metrics, *workers = \
            free_ports(6 + 2 * num_workers)
        return cls(gateway=gateway, gateway_grpc=gateway_grpc, scheduler=scheduler,
                   scheduler_metrics=scheduler_metrics, kvcache=kvcache, kvcache_metrics=kvcache_metrics,
                   workers=list(zip(workers[::2], workers[1::2])))


@dataclass
class Stack:
    ports: StackPorts
    env: dict[str, str]
    log_dir: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    # How each process was started (module, extra environment), to start it again.
    launches: dict[str, tuple[str, dict[str, str]]] = field(default_factory=dict)
    root: Path = ROOT       # the checkout the services run from (an A/B runs two: benchmarks/ab_stacks.py)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.gateway}"

    def service_env(self) -> dict[str, str]:
        p = self.ports
        env = dict(os.environ)
        env.update({
            "GATEWAY_PORT": str(p.gateway), "GATEWAY_GRPC_PORT": str(p.gateway_grpc),
            "SCHEDULER_PORT": str(p.scheduler), "SCHEDULER_METRICS_PORT": str(p.scheduler_metrics),
            "SCHEDULER_ADDR": f"127.0.0.1:{p.scheduler}",
            "KVCACHE_PORT": str(p.kvcache), "KVCACHE_METRICS_PORT": str(p.kvcache_metrics),
            "KVCACHE_ADDR": f"127.0.0.1:{p.kvcache}",
            "PYTHONUNBUFFERED": "1",
        })
        env.update(self.env)
        return env

    def internal_auth(self) -> "InternalAuth":
        """The token and TLS the services run with (INTERNAL_TOKEN, GRPC_TLS_*
        from the environment or `env`), for clients that dial them directly."""
        from common.transport.internal_auth import InternalAuth

        return InternalAuth.from_env(self.service_env(), serves=False)

    def worker_token(self) -> bytes:
        """The workers' token (WORKER_TOKEN, checked against INTERNAL_TOKEN), for
        clients that play a worker."""
        from common.transport.worker_auth import worker_token_from_env

        return worker_token_from_env(self.service_env(), self.internal_auth().token)

    def _spawn(self, name: str, module: str, extra: dict[str, str] | None = None) -> None:
        env = self.service_env()
        env.update(extra or {})
        if module not in WORKER_ROLE_MODULES:
            for variable in WORKER_ONLY:
                env.pop(variable, None)
        self.launches[name] = (module, dict(extra or {}))
        with open(self.log_dir / f"{name}.log", "ab") as log_file:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", module], cwd=self.root, env=env, stdout=log_file,
                stderr=subprocess.STDOUT, start_new_session=True,
            )

    def respawn(self, name: str) -> None:
        """Starts a service again the way it was first started (module, ports, id)."""
        module, extra = self.launches[name]
        self._spawn(name, module, extra)

    def start(self, timeout_s: float = 300.0) -> "Stack":
        stale = stale_stubs(self.root)
        if stale is not None:
            raise RuntimeError(stale)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._spawn("kvcache", "services.kvcache.main")
        self._spawn("scheduler", "services.scheduler.main")
        for index, (port, metrics_port) in enumerate(self.ports.workers):
            self._spawn(f"worker-{index}", "services.worker.main", {
                "WORKER_PORT": str(port), "WORKER_METRICS_PORT": str(metrics_port),
                "WORKER_ID": f"worker-{index}",
            })
        self._spawn("gateway", "services.gateway.main")
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def add_worker(self, name: str, port: int, metrics_port: int) -> None:
        self._spawn(name, "services.worker.main", {
            "WORKER_PORT": str(port), "WORKER_METRICS_PORT": str(metrics_port), "WORKER_ID": name})

    def wait_ready(self, timeout_s: float, workers: int | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        reason = "not started"
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}; see "
                                       f"{self.log_dir / (name + '.log')}:\n{self.tail(name)}")
            try:
                with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except urllib.error.HTTPError as error:
                reason = error.read().decode(errors="replace")
            except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
                reason = str(error)   # not up yet, or something else answers on the port
            time.sleep(0.25)
        raise TimeoutError(f"gateway not ready after {timeout_s}s: {reason}")

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; see "
                                   f"{self.log_dir / (name + '.log')}:\n{self.tail(name)}")

    def wait_workers(self, count: int, timeout_s: float) -> None:
        """Waits until the scheduler reports `count` healthy workers (the gateway
        is ready as soon as one has registered)."""
        import json

        deadline = time.monotonic() + timeout_s
        healthy = 0
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(f"{self.url}/stats", timeout=5) as reply:
                    scheduler = json.load(reply).get("scheduler") or {}
                healthy = sum(1 for worker in scheduler.get("workers", []) if worker["healthy"])
                if healthy >= count:
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{healthy} of {count} workers registered after {timeout_s}s")

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def kill(self, name: str) -> None:
        process = self.processes[name]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def restart_kvcache(self, timeout_s: float = 30.0) -> None:
        """Kills the kvcache index service and starts it again on the same port,
        waiting until it answers its gRPC health check."""
        self.kill("kvcache")
        self.respawn("kvcache")
        self.wait_serving("kvcache", f"127.0.0.1:{self.ports.kvcache}", timeout_s)

    def start_scheduler_again(self, timeout_s: float = 60.0) -> None:
        """Starts the scheduler again on the same port once it has been killed
        (kill("scheduler")), waiting until it answers its gRPC health check."""
        self.respawn("scheduler")
        self.wait_serving("scheduler", f"127.0.0.1:{self.ports.scheduler}", timeout_s)

    def wait_serving(self, name: str, address: str, timeout_s: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from common.transport.grpc_server import blocking_channel

        deadline = time.monotonic() + timeout_s
        with blocking_channel(address, self.internal_auth()) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                process = self.processes[name]
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.tail(name)}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"{name} not serving at {address} after {timeout_s}s")
