"""Drain on SIGTERM through the real stack (tiny model, two workers): a worker
leaving hands its greedy stream to the other worker, which ends it with the
tokens an undisturbed run gives, and exits 0; then a gateway leaving answers
/ready and a new request with 503 (health stays 200), finishes the stream in
flight and exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fairserve.launcher.stack import Stack
from tests.integration.conftest import start_stack
from tests.integration.helpers import stream_generate

BODY = {"prompt": "Once upon a time there was", "raw": True, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("drain"), tiny_model_dir, num_workers=2)
    stack.wait_workers(2, timeout_s=120)
    yield stack
    stack.stop()


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def stream_in_background(url: str, body: dict[str, Any]) -> tuple[threading.Thread, list[dict[str, Any]]]:
    """Streams /generate on a thread; the events land in the list as they come."""
    events: list[dict[str, Any]] = []

    def run() -> None:
        with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=120) as reply:
            events.append({"status": reply.status_code})
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[len("data: "):]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, events


def scheduler_stats(stack: Stack) -> dict[str, Any]:
    return httpx.get(f"{stack.url}/stats", timeout=10).json()["scheduler"]


def token_ids(events: list[dict[str, Any]]) -> list[int]:
    return [event["token_id"] for event in events if "token_id" in event]


def test_a_worker_leaving_hands_its_stream_over_with_the_same_greedy_tokens(stack: Stack) -> None:
    body = {**BODY, "max_tokens": 300}
    reference = token_ids(stream_generate(stack.url, body))
    assert len(reference) == 300
    before = scheduler_stats(stack)["migrations"]
    thread, events = stream_in_background(stack.url, body)
    wait_until(lambda: len(events) > 10, "the stream's first tokens")
    [name] = [w["worker_id"] for w in scheduler_stats(stack)["workers"] if w["running"]]
    leaving = stack.processes[name]
    leaving.send_signal(signal.SIGTERM)
    thread.join(timeout=120)
    assert events[0] == {"status": 200} and events[-1]["finish_reason"] == "length", events[-1]
    assert token_ids(events) == reference
    assert leaving.wait(timeout=60) == 0
    after = scheduler_stats(stack)
    assert [w["worker_id"] for w in after["workers"]] == [w for w in ("worker-0", "worker-1") if w != name]
    assert after["migrations"] == before + 1
    assert '"end": "drained"' in stack.tail(name, 200)


def test_a_gateway_leaving_finishes_its_stream_and_refuses_new_requests(stack: Stack) -> None:
    thread, events = stream_in_background(stack.url, {**BODY, "max_tokens": 500})
    wait_until(lambda: len(events) > 5, "the stream's first tokens")
    gateway = stack.processes["gateway"]
    gateway.send_signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(f"{stack.url}/ready", timeout=5).status_code == 503, "/ready to say 503")
    refused = httpx.post(f"{stack.url}/generate", json={**BODY, "max_tokens": 4}, timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
    assert httpx.get(f"{stack.url}/health", timeout=5).status_code == 200
    assert len(token_ids(events)) < 500           # all of that while the stream ran
    thread.join(timeout=120)
    assert events[-1]["finish_reason"] == "length" and len(token_ids(events)) == 500, events[-1]
    assert gateway.wait(timeout=60) == 0
