"""Issue 38's attacks on the public doors, played against a real stack (tiny model) with only
API_KEYS set: a flood of half-open connections, an over-long /tokenize text, a 3,006-character
x-request-id on the public gRPC port and a 20,000-option guided_choice. Each one failed before
(a 503, a full tokenization, the id logged as sent, a second of compiling in the worker)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from fairserve.v1 import gateway_pb2, gateway_pb2_grpc

from scripts.stack import Stack
from tests.integration.conftest import start_stack

ALICE = {"authorization": "Bearer sk-isolation-alice-0001"}
KEYS = "alice=sk-isolation-alice-0001,bob=sk-isolation-bob-0001"


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(tmp_path_factory.mktemp("doors-stack"), tiny_model_dir,
                          extra_env={"API_KEYS": KEYS})
    yield running
    running.stop()


def test_half_open_connections_leave_a_keyed_request_served(stack: Stack) -> None:
    """1,100 connections opened without a key, each with a partial request line (past
    GATEWAY_MAX_CONNECTIONS' 1,024, which uvicorn counted them against: the keyed request got
    a 503). Now they are capped apart and lose their oldest; the request is served in < 5 s."""
    flood: list[socket.socket] = []
    try:
        for _ in range(1100):
            sock = socket.create_connection(("127.0.0.1", stack.ports.gateway), timeout=5)
            sock.sendall(b"GET /v1/models HT")
            flood.append(sock)
        time.sleep(0.5)
        started = time.monotonic()
        reply = httpx.post(f"{stack.url}/v1/completions", headers=ALICE, timeout=30,
                           json={"prompt": "Hello", "max_tokens": 2})
        took = time.monotonic() - started
        assert reply.status_code == 200, reply.text
        assert took < 5, took
    finally:
        for sock in flood:
            sock.close()


def test_an_over_long_text_is_refused_before_tokenizing(stack: Stack) -> None:
    text = "word " * 150_000         # 750 KB: far past what the context could hold
    started = time.monotonic()
    reply = httpx.post(f"{stack.url}/tokenize", headers=ALICE, json={"prompt": text}, timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    assert reply.json()["error"]["param"] == "prompt"
    assert time.monotonic() - started < 5


def test_grpc_request_id_is_bounded_and_never_logged(stack: Stack) -> None:
    long_id = "R" * 3006
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports.gateway_grpc}") as channel:
        stub = gateway_pb2_grpc.TextGenerationStub(channel)
        reply = stub.Generate(gateway_pb2.TextRequest(prompt="Hi", max_tokens=2), timeout=60,
                              metadata=(("x-request-id", long_id), ("authorization", ALICE["authorization"])))
    assert reply.finish_reason
    for name in ("gateway", "scheduler", "worker-0"):
        assert "R" * 200 not in (stack.log_dir / f"{name}.log").read_text(errors="replace"), name


def test_a_huge_guided_choice_is_refused_at_the_gateway(stack: Stack) -> None:
    started = time.monotonic()
    reply = httpx.post(f"{stack.url}/v1/completions", headers=ALICE, timeout=30, json={
        "prompt": "Pick", "max_tokens": 4, "guided_choice": [f"option {i}" for i in range(20_000)]})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "guided_choice"
    assert time.monotonic() - started < 5
