"""The stack without its KV index (tiny model, real processes): while the
kvcache service is down, serving goes on and the gateway stays ready but says
it is degraded (/health, /stats, metrics); a restarted in-memory index gets
the blocks of a worker that has nothing new to publish back by itself."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.integration.conftest import start_stack
from tests.integration.test_prefix_cache import BLOCK_SIZE, Probe, complete_ids, random_ids


def eventually(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.2)


def degraded(url: str) -> list[str]:
    reply = httpx.get(f"{url}/health", timeout=5)
    assert reply.status_code == 200
    return reply.json()["degraded"]


def test_serving_goes_on_without_the_index_and_a_restarted_one_is_rebuilt(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    stack = start_stack(tmp_path, tiny_model_dir)
    probe = Probe(stack)
    try:
        rng = random.Random(5)
        prefix = random_ids(rng, 8 * BLOCK_SIZE)
        complete_ids(stack.url, prefix + random_ids(rng, 3), max_tokens=4)
        probe.wait_quiescent()
        held = probe.lookup(prefix)
        assert held == {"worker-0": len(prefix)}
        probe.close()

        stack.kill("kvcache")
        assert httpx.get(f"{stack.url}/ready", timeout=10).status_code == 200
        eventually(lambda: degraded(stack.url) == ["kvcache"])
        again = complete_ids(stack.url, prefix + random_ids(rng, 3), max_tokens=4)
        assert again.cached_tokens >= len(prefix)          # the worker's own cache still serves
        stats = httpx.get(f"{stack.url}/stats", timeout=10).json()
        assert stats["kvcache"] is None and stats["dependencies"] == {"scheduler": True, "kvcache": False}
        metrics = httpx.get(f"{stack.url}/metrics", timeout=10).text
        assert 'fairserve_gateway_dependency_up{dependency="kvcache"} 0.0' in metrics

        stack.respawn("kvcache")                          # empty: it knows no worker
        stack.wait_serving("kvcache", f"127.0.0.1:{stack.ports.kvcache}", 30)
        probe = Probe(stack)
        eventually(lambda: probe.lookup(prefix) == held)
        eventually(lambda: degraded(stack.url) == [])

        probe.wait_quiescent()
        probe.close()
        stack.restart_kvcache()                           # and now with nothing to publish
        probe = Probe(stack)
        eventually(lambda: probe.lookup(prefix) == held)  # the idle worker's keepalive brought it back
    finally:
        probe.close()
        stack.stop()
