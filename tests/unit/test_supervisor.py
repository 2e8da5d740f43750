"""`make run`'s supervision: the backoff policy on a fake clock, and the
supervisor restarting a fake stack's exited processes and counting them."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from common.settings.env import SettingsError
from fairserve.launcher.supervisor import Backoff, Supervisor, SupervisorMetrics, SupervisorSettings, describe_exit


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeProcess:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class FakeStack:
    def __init__(self, *names: str) -> None:
        self.pids = iter(range(1000, 2000))
        self.processes = {name: FakeProcess(next(self.pids)) for name in names}
        self.respawned: list[str] = []

    def respawn(self, name: str) -> None:
        self.respawned.append(name)
        self.processes[name] = FakeProcess(next(self.pids))

    def tail(self, name: str, lines: int = 40) -> str:
        return f"last words of {name}"


def test_backoff_doubles_up_to_its_cap_and_resets_after_a_minute_of_health() -> None:
    clock = FakeClock()
    backoff = Backoff(clock)
    delays = []
    for _ in range(7):
        clock.now += 1.0      # each start lasts a second
        delays.append(backoff.delay())
        backoff.started()
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    clock.now += 59.9
    assert backoff.delay() == 10.0
    backoff.started()
    clock.now += 60.0
    assert backoff.delay() == 0.5


def test_the_supervisor_restarts_an_exited_service_after_its_backoff_and_counts_it() -> None:
    clock, stack, said = FakeClock(), FakeStack("kvcache", "scheduler"), []
    metrics = SupervisorMetrics(wall_clock=lambda: 1234.0)
    supervisor = Supervisor(stack, metrics, clock=clock, say=said.append)  # type: ignore[arg-type]
    text = generate_latest(metrics.registry).decode()
    assert 'fairserve_supervisor_restarts_total{service="kvcache"} 0.0' in text
    assert 'fairserve_supervisor_start_time_seconds{service="scheduler"} 1234.0' in text

    stack.processes["kvcache"].returncode = -9
    supervisor.check()
    assert stack.respawned == [] and len(said) == 1
    assert "kvcache exited with signal 9 (SIGKILL)" in said[0] and "last words of kvcache" in said[0]
    assert "0.5 s" in said[0]
    clock.now = 100.4
    supervisor.check()
    assert stack.respawned == []
    clock.now = 100.5
    supervisor.check()
    assert stack.respawned == ["kvcache"] and "started again (pid 1002)" in said[-1]
    supervisor.check()                               # the new process runs: nothing to do
    assert stack.respawned == ["kvcache"]

    stack.processes["kvcache"].returncode = 1       # exits again at once: the wait doubles
    supervisor.check()
    assert "exited with code 1; starting it again in 1 s" in said[-1]
    clock.now += 1.0
    supervisor.check()
    text = generate_latest(metrics.registry).decode()
    assert 'fairserve_supervisor_restarts_total{service="kvcache"} 2.0' in text
    assert 'fairserve_supervisor_restarts_total{service="scheduler"} 0.0' in text


def test_run_checks_until_interrupted() -> None:
    stack = FakeStack("gateway")
    supervisor = Supervisor(stack, SupervisorMetrics(), say=lambda line: None)  # type: ignore[arg-type]
    naps = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        supervisor.run(sleep)
    assert len(naps) == 3


def test_settings_and_exit_descriptions() -> None:
    assert SupervisorSettings.from_env({}).metrics_port == 9104
    assert SupervisorSettings.from_env({"SUPERVISOR_METRICS_PORT": "0"}).metrics_port == 0
    with pytest.raises(SettingsError, match="SUPERVISOR_METRICS_PORT"):
        SupervisorSettings.from_env({"SUPERVISOR_METRICS_PORT": "http"})
    assert describe_exit(0) == "code 0"
    assert describe_exit(-15) == "signal 15 (SIGTERM)"


def test_the_launcher_stops_on_a_bad_supervisor_setting(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Path) -> None:
    from fairserve.launcher import run_stack
    from fairserve.launcher.stack import Stack

    for name in ("INTERNAL_TOKEN", "INTERNAL_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SUPERVISOR_METRICS_PORT", "70000")
    monkeypatch.setenv("LOG_DIR", str(tmp_path))
    monkeypatch.setattr(Stack, "start", lambda *_: pytest.fail("started with a bad setting"))
    assert run_stack.main() == 2
    assert "SUPERVISOR_METRICS_PORT=70000 is invalid" in capsys.readouterr().err
