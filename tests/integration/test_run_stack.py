"""`make run`'s launcher: serves, Ctrl-C leaves no process behind, and its
internal ports are closed by tokens of its own."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import psutil
import pytest

from fairserve.launcher.stack import free_ports
from tests.integration.conftest import TINY_ENV
from tests.integration.helpers import start_launcher


def test_ctrl_c_stops_every_service(tiny_model_dir: Path, tmp_path: Path) -> None:
    names = ("GATEWAY_PORT", "GATEWAY_GRPC_PORT", "SCHEDULER_PORT", "SCHEDULER_METRICS_PORT",
             "KVCACHE_PORT", "KVCACHE_METRICS_PORT", "WORKER_PORT", "WORKER_METRICS_PORT",
             "SUPERVISOR_METRICS_PORT")
    ports = dict(zip(names, map(str, free_ports(len(names)))))
    gateway = int(ports["GATEWAY_PORT"])
    env = {**os.environ, **TINY_ENV, "MODEL_NAME": str(tiny_model_dir), "LOG_DIR": str(tmp_path),
           "LOCAL_TOKENS_FILE": str(tmp_path / "tokens" / "local.json"), **ports}
    empty = tmp_path / "empty"
    empty.mkdir()     # `fairserve run` from any directory, its settings as flags
    env["SERVED_MODEL_NAME"] = "my-model"
    launcher, banner = start_launcher(env, cwd=empty, args=("--max-batch-size", "4"))
    try:
        assert f"127.0.0.1:{gateway}" in banner and "curl -N" in banner
        children = psutil.Process(launcher.pid).children(recursive=True)
        assert len(children) == 4
        reply = httpx.post(f"http://127.0.0.1:{gateway}/generate",
                           json={"prompt": "Hello", "max_tokens": 4, "stream": False}, timeout=60)
        assert reply.status_code == 200
        url = f"http://127.0.0.1:{gateway}"
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["my-model"]
        body = {"prompt": "Hello", "max_tokens": 2}
        served = httpx.post(f"{url}/v1/completions", json={**body, "model": "my-model"}, timeout=60)
        assert served.status_code == 200 and served.json()["model"] == "my-model"
        missing = httpx.post(f"{url}/v1/completions", json={**body, "model": "nope"}, timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
        assert httpx.get(f"{url}/version").status_code == 200

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


async def test_plain_make_run_closes_its_internal_ports(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With no token given, the launcher makes its own (a private file, reused):
    an internal call without a token is UNAUTHENTICATED, RegisterWorker with the
    services' token is PERMISSION_DENIED, and with the worker token accepted."""
    import grpc
    from fairserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

    from common.transport.grpc_server import insecure_channel, internal_channel
    from common.transport.internal_auth import InternalAuth
    from common.transport.worker_auth import worker_token_interceptors
    from tests.unit.scheduler.fake_worker import FakeEngine
    from tests.unit.scheduler.fake_worker_server import FakeWorkerProcess

    names = ("GATEWAY_PORT", "GATEWAY_GRPC_PORT", "SCHEDULER_PORT", "SCHEDULER_METRICS_PORT",
             "KVCACHE_PORT", "KVCACHE_METRICS_PORT", "WORKER_PORT", "WORKER_METRICS_PORT",
             "SUPERVISOR_METRICS_PORT")
    ports = dict(zip(names, map(str, free_ports(len(names)))))
    tokens_file = tmp_path / "cache" / "tokens" / "local.json"
    env = {name: value for name, value in os.environ.items()
           if name not in ("INTERNAL_TOKEN", "INTERNAL_TOKEN_FILE", "WORKER_TOKEN", "WORKER_TOKEN_FILE")}
    env.update({**TINY_ENV, "MODEL_NAME": str(tiny_model_dir), "LOG_DIR": str(tmp_path),
                "LOCAL_TOKENS_FILE": str(tokens_file), **ports})
    launcher, banner = start_launcher(env)
    scheduler = f"127.0.0.1:{ports['SCHEDULER_PORT']}"
    try:
        assert "InternalAuth(token=set" in banner and str(tokens_file) in banner
        assert oct(tokens_file.stat().st_mode & 0o777) == "0o600"
        assert oct(tokens_file.parent.stat().st_mode & 0o777) == "0o700"
        tokens = json.loads(tokens_file.read_text())
        assert tokens["INTERNAL_TOKEN"] not in banner and tokens["WORKER_TOKEN"] not in banner
        services = InternalAuth(token=tokens["INTERNAL_TOKEN"].encode())
        async with insecure_channel(scheduler) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as anonymous:
                await scheduler_pb2_grpc.SchedulerStub(channel).Stats(common_pb2.StatsRequest(), timeout=10)
        assert anonymous.value.code() is grpc.StatusCode.UNAUTHENTICATED
        probe = FakeWorkerProcess(FakeEngine(num_blocks=64), "probe", scheduler, auth=services)
        with pytest.raises(grpc.aio.AioRpcError) as gateway_token:
            await probe.start()
        await probe.stop()
        assert gateway_token.value.code() is grpc.StatusCode.PERMISSION_DENIED
        worker = FakeWorkerProcess(FakeEngine(num_blocks=64), "probe", scheduler, auth=services,
                                   worker_token=tokens["WORKER_TOKEN"].encode())
        try:
            await worker.start()
            assert worker.epoch > 0
            async with internal_channel(scheduler, services,
                                        worker_token_interceptors(tokens["WORKER_TOKEN"].encode())) as channel:
                await scheduler_pb2_grpc.SchedulerStub(channel).DrainWorker(   # leaves the stack as it was
                    scheduler_pb2.DrainWorkerRequest(worker_id="probe"), timeout=10)
        finally:
            await worker.stop()
    finally:
        leftovers = psutil.Process(launcher.pid).children(recursive=True)
        launcher.send_signal(signal.SIGINT)
        try:
            launcher.wait(timeout=30)
        finally:
            psutil.wait_procs(leftovers, timeout=15)
            for process in leftovers:
                if process.is_running():
                    process.kill()
