"""`python -m services.gateway.main` as a real process: it serves HTTP and
gRPC, reports not-ready without a scheduler, and stops on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.unit.gateway.fakes import free_port

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    from tests.fixtures.tiny_model import gemma3_config

    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    tokenizer.save_pretrained(directory)
    gemma3_config(vocab_size=len(tokenizer)).save_pretrained(directory)
    return directory


@pytest.fixture
def gateway(tokenizer_dir: Path) -> Iterator[tuple[subprocess.Popen[str], int, int]]:
    yield from run_gateway(tokenizer_dir, {})


def run_gateway(tokenizer_dir: Path,
                extra_env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], int, int]]:
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "GATEWAY_PORT": str(http_port), "GATEWAY_GRPC_PORT": str(grpc_port),
           "SCHEDULER_ADDR": f"127.0.0.1:{free_port()}", "KVCACHE_ADDR": f"127.0.0.1:{free_port()}",
           "MODEL_NAME": str(tokenizer_dir), "PYTHONPATH": str(ROOT), **extra_env}
    process = subprocess.Popen([sys.executable, "-m", "services.gateway.main"], cwd=ROOT, env=env,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.1)
        yield process, http_port, grpc_port
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serves_reports_not_ready_and_stops_on_sigterm(
        gateway: tuple[subprocess.Popen[str], int, int]) -> None:
    process, http_port, grpc_port = gateway
    base = f"http://127.0.0.1:{http_port}"
    ready = httpx.get(f"{base}/ready", timeout=5)
    assert ready.status_code == 503 and ready.json()["error"]["message"]
    response = httpx.post(f"{base}/generate", json={"prompt": "Hi", "stream": False}, timeout=10)
    assert response.status_code == 503, response.text
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 0
    assert process.stderr is not None
    logs = [json.loads(line) for line in process.stderr.read().splitlines() if line.startswith("{")]
    access = [entry for entry in logs if entry.get("msg") == "request"]
    assert {(entry["method"], entry["path"], entry["status"]) for entry in access} >= {
        ("GET", "/ready", 503), ("POST", "/generate", 503)}
    assert all("duration_ms" in entry and "request_id" in entry for entry in access)


def test_a_warning_when_keys_are_set_without_an_internal_token(caplog: pytest.LogCaptureFixture) -> None:
    from services.gateway.main import warn_if_internal_ports_open
    from services.gateway.settings import GatewaySettings

    caplog.set_level("WARNING")
    warn_if_internal_ports_open(GatewaySettings.from_env({"API_KEYS": "alice=sk-alice-0123456789"}))
    assert "API keys are set but INTERNAL_TOKEN is not" in caplog.text and "sk-alice" not in caplog.text
    caplog.clear()
    warn_if_internal_ports_open(GatewaySettings.from_env({}))            # an open API: nothing to guard
    warn_if_internal_ports_open(GatewaySettings.from_env({"API_KEYS": "alice=sk-alice-0123456789",
                                                          "INTERNAL_TOKEN": "internal-token-0123456789"}))
    assert caplog.text == ""
def test_metrics_port_serves_metrics_there_only(tokenizer_dir: Path) -> None:
    metrics_port = free_port()
    runs = run_gateway(tokenizer_dir, {"METRICS_PORT": str(metrics_port)})
    process, http_port, _grpc_port = next(runs)
    try:
        public = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=5)
        assert public.status_code == 404, public.text
        private = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
        assert private.status_code == 200 and "fairserve_gateway_dependency_up" in private.text
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/stats", timeout=5).status_code == 404
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        runs.close()
