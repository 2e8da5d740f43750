"""`make run`'s launcher: serves, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import psutil

from scripts.stack import free_ports
from tests.integration.conftest import TINY_ENV
from tests.integration.helpers import start_launcher


def test_ctrl_c_stops_every_service(tiny_model_dir: Path, tmp_path: Path) -> None:
    names = ("GATEWAY_PORT", "GATEWAY_GRPC_PORT", "SCHEDULER_PORT", "SCHEDULER_METRICS_PORT",
             "KVCACHE_PORT", "KVCACHE_METRICS_PORT", "WORKER_PORT", "WORKER_METRICS_PORT",
             "SUPERVISOR_METRICS_PORT")
    ports = dict(zip(names, map(str, free_ports(len(names)))))
    gateway = int(ports["GATEWAY_PORT"])
    env = {**os.environ, **TINY_ENV, "MODEL_NAME": str(tiny_model_dir), "LOG_DIR": str(tmp_path), **ports}
    launcher, banner = start_launcher(env)
    try:
        assert f"127.0.0.1:{gateway}" in banner and "curl -N" in banner
        children = psutil.Process(launcher.pid).children(recursive=True)
        assert len(children) == 4
        reply = httpx.post(f"http://127.0.0.1:{gateway}/generate",
                           json={"prompt": "Hello", "max_tokens": 4, "stream": False}, timeout=60)
        assert reply.status_code == 200

        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"left behind: {[p.cmdline() for p in alive]}"
    finally:
        if launcher.poll() is None:  # a failed check: take down what it started too
            leftovers = psutil.Process(launcher.pid).children(recursive=True)
            launcher.kill()
            for process in leftovers:
                process.kill()
