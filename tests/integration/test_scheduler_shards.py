"""Two scheduler shards behind one gateway (tiny model), set up as the Helm chart does: the
second shard's SCHEDULER_PEERS lists both shards, itself included (it leaves itself out),
and its worker, given SCHEDULER_SHARDS instead of an address, joins the shard with fewer
workers (the second: the first has worker-0); the gateway (SCHEDULER_SHARDS) spreads requests
over both, /stats shows both shards' workers, and when one shard is killed mid-stream its
requests go on, as continuations, on the other: every stream ends with what it gives
undisturbed, and no client sees an error."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fairserve.launcher.stack import Stack, free_port
from tests.integration.conftest import start_stack
from tests.integration.test_scheduler_restart import Streamed, stream
from tests.integration.test_scheduler_stack import Prompts, generate_body, until

TOKENS = 400       # long enough that every stream is still going when a shard is killed
WAIT_S = 120.0


@pytest.fixture(scope="module")
def shards(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    second, second_metrics = free_port(), free_port()
    stack = start_stack(tmp_path_factory.mktemp("shards"), tiny_model_dir, extra_env={"SCHEDULER_RECOVERY_S": "60"})
    first = f"127.0.0.1:{stack.ports.scheduler}"
    try:
        # The second shard and its worker, then the gateway again over both shards.
        stack._spawn("scheduler-2", "services.scheduler.main", {
            "SCHEDULER_PORT": str(second), "SCHEDULER_METRICS_PORT": str(second_metrics),
            "SCHEDULER_PEERS": f"{first},127.0.0.1:{second}"})
        stack.wait_serving("scheduler-2", f"127.0.0.1:{second}", 60)
        worker_port, worker_metrics = free_port(), free_port()
        stack._spawn("worker-2", "services.worker.main", {
            "WORKER_PORT": str(worker_port), "WORKER_METRICS_PORT": str(worker_metrics),
            "WORKER_ID": "worker-2", "SCHEDULER_SHARDS": f"{first},127.0.0.1:{second}"})
        stack.kill("gateway")
        stack._spawn("gateway", "services.gateway.main", {"SCHEDULER_SHARDS": f"{first},127.0.0.1:{second}"})
        stack.wait_ready(120)
        stack.second_metrics_port = second_metrics   # type: ignore[attr-defined]
        yield stack
    finally:
        stack.stop()


def _workers(stats: dict) -> set[str]:
    return {worker["worker_id"] for worker in stats["scheduler"]["workers"]}


def _steps(stats: dict) -> dict[str, int]:
    return {worker["worker_id"]: worker["steps"] for worker in stats["scheduler"]["workers"]}


async def test_requests_spread_over_the_shards_and_survive_one_killed(shards: Stack) -> None:
    prompts = Prompts()
    bodies = {f"s{i}": generate_body(prompts.next(), TOKENS) for i in range(4)}
    async with httpx.AsyncClient(base_url=shards.url, timeout=WAIT_S) as client:
        async def both_workers() -> bool:
            return _workers((await client.get("/stats")).json()) == {"worker-0", "worker-2"}
        for _ in range(240):
            if await both_workers():
                break
            await asyncio.sleep(0.25)
        stats = (await client.get("/stats")).json()
        assert _workers(stats) == {"worker-0", "worker-2"}, stats["scheduler"]
        healthy = 'fairserve_scheduler_worker_healthy{worker="%s"} 1.0'
        for _ in range(100):     # the second shard's metrics are published every reaper tick
            on_second = httpx.get(f"http://127.0.0.1:{shards.second_metrics_port}/metrics").text  # type: ignore[attr-defined]
            if healthy % "worker-2" in on_second:
                break
            await asyncio.sleep(0.1)
        assert healthy % "worker-2" in on_second and 'worker="worker-0"' not in on_second
        assert all(stats["scheduler"]["shards"].values())

        steps_before = _steps(stats)
        seen = {name: Streamed() for name in bodies}
        tasks = {name: asyncio.create_task(stream(client, body, seen[name])) for name, body in bodies.items()}
        await until(lambda: all(len(s.token_ids) >= 8 for s in seen.values()), "every stream's 8th token")
        # Both shards serve: each worker has stepped since (its running count at one moment
        # is not a test: a fast stream can have ended by then).
        for _ in range(100):
            steps_now = _steps((await client.get("/stats")).json())
            if all(steps_now[worker] > steps_before[worker] for worker in steps_before):
                break
            await asyncio.sleep(0.05)
        assert all(steps_now[worker] > steps_before[worker] for worker in steps_before), (steps_before, steps_now)

        await asyncio.to_thread(shards.kill, "scheduler-2")   # SIGKILL, as a crash would
        cut = {name: len(s.token_ids) for name, s in seen.items()}
        results = await asyncio.wait_for(asyncio.gather(*tasks.values()), WAIT_S)
        assert any(count < TOKENS for count in cut.values()), cut     # the kill came mid-stream
        for name, result in zip(bodies, results):
            assert result.status == 200 and result.error is None, (name, result)
            assert result.finish_reason == "length" and len(result.token_ids) == TOKENS, (name, result)
        for name, result in zip(bodies, results):      # no gap, no repeat
            alone = await stream(client, bodies[name])
            assert (result.token_ids, result.text) == (alone.token_ids, alone.text), name
        assert (await client.get("/ready")).status_code == 200     # one shard still serves
