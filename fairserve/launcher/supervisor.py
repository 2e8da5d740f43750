"""`make run`'s supervision of the stack's processes. A service that exits
while the stack runs is started again (same module, ports and id) after a
backoff: 0.5 s after its first exit, doubling with each exit that follows up
to 10 s, and 0.5 s again once a start has lasted a minute. Each exit is
printed with its exit code and the service's last log lines, and counted on
the launcher's own Prometheus endpoint (SUPERVISOR_METRICS_PORT, default
9104): restarts per service and when each service's current process started.
The backoff is a pure policy on an injected clock; stopping the stack (Ctrl-C,
SIGTERM) is the launcher's (run_stack.py)."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NoReturn

from prometheus_client import CollectorRegistry

from common.observability import prometheus_names as names
from fairserve.launcher.settings_schema import RunSchema
from fairserve.launcher.stack import Stack

CHECK_INTERVAL_S = 0.2
TAIL_LINES = 20


@dataclass(frozen=True)
class SupervisorSettings:
    metrics_port: int = 9104      # 0 picks a free port
    metrics_host: str = "127.0.0.1"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SupervisorSettings:
        values = RunSchema.read(env)
        return cls(metrics_port=values.supervisor_metrics_port)


class Backoff:
    """How long one service waits before it is started again: `initial_s` after
    an exit, doubling with each exit that follows up to `max_s`. A start that
    lasted `healthy_s` or longer was healthy: the next exit waits `initial_s`."""

    def __init__(self, clock: Callable[[], float], initial_s: float = 0.5, max_s: float = 10.0,
                 healthy_s: float = 60.0) -> None:
        self._clock = clock
        self._initial_s = initial_s
        self._max_s = max_s
        self._healthy_s = healthy_s
        self._next_s = initial_s
        self._started_at = clock()

    def started(self) -> None:
        """The service was started (again) now."""
        self._started_at = self._clock()

    def delay(self) -> float:
        """The wait before the next start, for an exit now."""
        if self._clock() - self._started_at >= self._healthy_s:
            self._next_s = self._initial_s
        delay = self._next_s
        self._next_s = min(delay * 2, self._max_s)
        return delay


class SupervisorMetrics:
    """fairserve_supervisor_restarts_total and _start_time_seconds, by service."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._wall_clock = wall_clock
        self._restarts = names.counter(names.SUPERVISOR_RESTARTS, self.registry)
        self._start_time = names.gauge(names.SUPERVISOR_START_TIME, self.registry)

    def started(self, service: str) -> None:
        """A service's first start: its restarts count from 0."""
        self._restarts.labels(service=service)
        self._start_time.labels(service=service).set(self._wall_clock())

    def restarted(self, service: str) -> None:
        self._restarts.labels(service=service).inc()
        self._start_time.labels(service=service).set(self._wall_clock())


def describe_exit(code: int) -> str:
    """`code 1`, or for a process killed by a signal `signal 9 (SIGKILL)`."""
    if code >= 0:
        return f"code {code}"
    try:
        return f"signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"signal {-code}"


class Supervisor:
    """Watches a started Stack's processes and starts again those that exit."""

    def __init__(self, stack: Stack, metrics: SupervisorMetrics,
                 clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
                 ) -> None:
        self._stack = stack
        self._metrics = metrics
        self._clock = clock
        self._say = say
        self._backoff = {name: Backoff(clock) for name in stack.processes}
        self._due: dict[str, float] = {}   # exited services: when to start them again
        for name in stack.processes:
            metrics.started(name)

    def check(self) -> None:
        """One look at every service: note the exits, start those whose wait is over."""
        for name, process in list(self._stack.processes.items()):
            if name in self._due:
                if self._clock() >= self._due[name]:
                    self._restart(name)
            elif (code := process.poll()) is not None:
                self._exited(name, code)

    def run(self, sleep: Callable[[float], None] = time.sleep) -> NoReturn:
        """Checks until interrupted (KeyboardInterrupt: the launcher stops the stack)."""
        while True:
            self.check()
            sleep(CHECK_INTERVAL_S)

    def _exited(self, name: str, code: int) -> None:
        delay = self._backoff[name].delay()
        self._due[name] = self._clock() + delay
        self._say(f"{name} exited with {describe_exit(code)}; starting it again in {delay:g} s. "
                  f"Its last log lines:\n{self._stack.tail(name, TAIL_LINES)}")

    def _restart(self, name: str) -> None:
        del self._due[name]
        self._stack.respawn(name)
        self._backoff[name].started()
        self._metrics.restarted(name)
        self._say(f"{name} started again (pid {self._stack.processes[name].pid})")
