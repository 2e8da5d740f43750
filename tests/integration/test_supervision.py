"""`make run` supervises its services: the kvcache and then the scheduler,
killed with SIGKILL, come back as new processes, the stack serves again, and
the launcher's metrics count the two restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from fairserve.launcher.stack import free_ports
from tests.integration.conftest import TINY_ENV
from tests.integration.helpers import start_launcher

PORTS = ("GATEWAY_PORT", "GATEWAY_GRPC_PORT", "SCHEDULER_PORT", "SCHEDULER_METRICS_PORT",
         "KVCACHE_PORT", "KVCACHE_METRICS_PORT", "WORKER_PORT", "WORKER_METRICS_PORT",
         "SUPERVISOR_METRICS_PORT")


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def child_running(launcher: subprocess.Popen[str], module: str) -> psutil.Process | None:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if module in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            pass
    return None


def serves(url: str) -> bool:
    try:
        reply = httpx.post(f"{url}/generate", json={"prompt": "Hello", "max_tokens": 4, "stream": False},
                           timeout=30)
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


def restarts(metrics_url: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=10).text
    return {sample.labels["service"]: sample.value for family in text_string_to_metric_families(text)
            if family.name == "fairserve_supervisor_restarts" for sample in family.samples
            if sample.name.endswith("_total")}


def test_killed_services_come_back_and_are_counted(tiny_model_dir: Path, tmp_path: Path) -> None:
    ports = dict(zip(PORTS, map(str, free_ports(len(PORTS)))))
    url = f"http://127.0.0.1:{ports['GATEWAY_PORT']}"
    metrics_url = f"http://127.0.0.1:{ports['SUPERVISOR_METRICS_PORT']}/metrics"
    env = {**os.environ, **TINY_ENV, "MODEL_NAME": str(tiny_model_dir), "LOG_DIR": str(tmp_path),
           "LOCAL_TOKENS_FILE": str(tmp_path / "tokens" / "local.json"), **ports}
    launcher, banner = start_launcher(env)
    try:
        assert metrics_url in banner and serves(url)
        assert restarts(metrics_url) == {"kvcache": 0, "scheduler": 0, "worker-0": 0, "gateway": 0}

        for module in ("services.kvcache.main", "services.scheduler.main"):
            old = child_running(launcher, module)
            assert old is not None, module
            old.kill()
            wait_until(lambda: (new := child_running(launcher, module)) is not None and new.pid != old.pid,
                       f"{module} to come back")
            wait_until(lambda: serves(url), f"the stack to serve after {module} came back")
        assert restarts(metrics_url) == {"kvcache": 1, "scheduler": 1, "worker-0": 0, "gateway": 0}

        children = psutil.Process(launcher.pid).children(recursive=True)
        assert len(children) == 4
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"left behind: {[p.cmdline() for p in alive]}"
        output = launcher.stdout.read()
        assert "kvcache exited with signal 9 (SIGKILL)" in output, output
        assert "scheduler exited with signal 9 (SIGKILL)" in output, output
    finally:
        if launcher.poll() is None:  # a failed check: take down what it started too
            leftovers = psutil.Process(launcher.pid).children(recursive=True)
            launcher.kill()
            for process in leftovers:
                process.kill()
