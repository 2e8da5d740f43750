"""A lone worker killed with SIGKILL mid-stream and started again: every stream
waits for it (WORKER_RECOVERY_S), /ready says why the gateway is not ready
meanwhile, and each stream ends exactly as its undisturbed run did (the chaos
suite's machinery, one worker, the worker fault)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from benchmarks.chaos import ChaosSettings, run_fault
from benchmarks.chaos_faults import Fault
from tests.integration.conftest import start_stack

TOKENS = 600


def _ready_reason(url: str, timeout_s: float = 30.0) -> str:
    """/ready's 503 body once the scheduler has seen the worker go ("" if it never did)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = httpx.get(f"{url}/ready", timeout=10)
        if reply.status_code != 200:
            return reply.text
        time.sleep(0.1)
    return ""


def test_a_lone_workers_streams_wait_for_its_restart_and_end_identical(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    stack = start_stack(tmp_path, tiny_model_dir, num_workers=1)
    reasons: list[str] = []

    def restart() -> None:
        # The streams are stranded on no worker: /ready says so before the worker is back.
        reasons.append(_ready_reason(stack.url))
        stack.respawn("worker-0")

    try:
        fault = Fault("worker (1 worker)", lambda: stack.kill("worker-0"), restart,
                      lambda: stack.wait_workers(1, 120))
        # Long enough that the kill lands mid-stream on the tiny model (hundreds of tokens a second).
        settings = ChaosSettings.quick_mode(streams=4, tokens=TOKENS, kill_after=6, down_s=1.5)

        async def go():
            async with httpx.AsyncClient(base_url=stack.url, timeout=300) as client:
                return await run_fault(client, fault, settings)

        report = asyncio.run(go())
    finally:
        stack.stop()
    assert report.streams == 4 and all(count < TOKENS for count in report.chunks_at_kill), report
    assert (report.accepted, report.completed) == (4, 4), report.details
    assert (report.lost, report.differed, report.duplicated, report.server_errors) == (0, 0, 0, 0), \
        report.details
    assert "4 request(s) wait for one to register" in reasons[0], reasons
    assert "WORKER_RECOVERY_S=60" in reasons[0], reasons
