"""What a slow or greedy HTTP client can hold: the body deadline (408), the
header deadline (the connection is closed), the cap on connections waiting
for headers (the oldest are closed), the limit on requests in flight (503)
and the header size limit (400), through real uvicorn where it matters."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from common.settings.env import SettingsError
from services.gateway.http_limits import PendingConnections, uvicorn_limits
from services.gateway.settings import GatewaySettings
from tests.unit.gateway.fakes import FakeScheduler, ServerThread

BODY = b'{"prompt": "Hi", "max_tokens": 2, "stream": false}'


def test_settings_and_their_defaults() -> None:
    settings = GatewaySettings.from_env({})
    assert (settings.max_connections, settings.header_timeout_s, settings.keep_alive_s,
            settings.body_timeout_s, settings.max_header_bytes,
            settings.grpc_max_message_bytes) == (1024, 10.0, 5, 30.0, 16384, 4 * 1024 * 1024)
    assert (settings.max_pending_connections, settings.max_pending_per_address) == (1024, 128)
    custom = GatewaySettings.from_env({
        "GATEWAY_MAX_CONNECTIONS": "10", "GATEWAY_HEADER_TIMEOUT_S": "2.5",
        "GATEWAY_KEEP_ALIVE_S": "3", "GATEWAY_BODY_TIMEOUT_S": "7",
        "GATEWAY_MAX_HEADER_BYTES": "8192", "GATEWAY_GRPC_MAX_MESSAGE_BYTES": "65536",
        "GATEWAY_MAX_PENDING_CONNECTIONS": "40", "GATEWAY_MAX_PENDING_PER_ADDRESS": "4"})
    limits = uvicorn_limits(custom)
    assert (limits["limit_concurrency"], limits["timeout_keep_alive"],
            limits["h11_max_incomplete_event_size"]) == (None, 3, 8192)
    assert custom.max_connections == 10
    assert limits["http"].header_timeout_s == 2.5
    assert (limits["http"].pending.max_total, limits["http"].pending.max_per_address) == (40, 4)
    assert (custom.body_timeout_s, custom.grpc_max_message_bytes) == (7.0, 65536)
    for name, value in (("GATEWAY_MAX_CONNECTIONS", "0"), ("GATEWAY_HEADER_TIMEOUT_S", "0"),
                        ("GATEWAY_MAX_PENDING_CONNECTIONS", "0"),
                        ("GATEWAY_MAX_PENDING_PER_ADDRESS", "-1"),
                        ("GATEWAY_KEEP_ALIVE_S", "x"), ("GATEWAY_BODY_TIMEOUT_S", "-1"),
                        ("GATEWAY_MAX_HEADER_BYTES", "10"),
                        ("GATEWAY_GRPC_MAX_MESSAGE_BYTES", str(2**40))):
        with pytest.raises(SettingsError, match=name):
            GatewaySettings.from_env({name: value})


async def test_a_body_that_stops_arriving_is_408(make_app: Callable[..., Any],
                                                 fake: FakeScheduler) -> None:
    app = make_app(fake, body_timeout_s=0.2)
    sent: list[dict[str, Any]] = []
    chunks = [{"type": "http.request", "body": BODY[:10], "more_body": True}]

    async def receive() -> dict[str, Any]:
        if chunks:
            return chunks.pop(0)
        await asyncio.sleep(3600)  # the client never sends the rest
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/generate", "raw_path": b"/generate",
             "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
             "root_path": "", "asgi": {"version": "3.0"}}
    started = time.monotonic()
    await asyncio.wait_for(app(scope, receive, send), 5)
    assert time.monotonic() - started < 2
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    assert b'"request_timeout"' in sent[1]["body"]
    assert fake.requests == []


async def test_the_body_deadline_ends_with_the_body(make_app: Callable[..., Any],
                                                    fake: FakeScheduler) -> None:
    fake.token_delay_s = 0.05  # the answer takes longer than the body deadline
    transport = httpx.ASGITransport(app=make_app(fake, body_timeout_s=0.2))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        reply = await http.post("/generate", content=BODY,
                                headers={"content-type": "application/json"})
        streamed = await http.post("/generate", json={"prompt": "Hi", "max_tokens": 8})
    assert reply.status_code == 200 and streamed.status_code == 200


def serve(make_app: Callable[..., Any], fake: FakeScheduler, **settings: Any) -> ServerThread:
    gateway = GatewaySettings(**settings)
    return ServerThread(make_app(fake, **settings), **uvicorn_limits(gateway)).__enter__()


def read_all(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything until the server closes, and how long that took."""
    sock.settimeout(timeout_s)
    started, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - started


def test_late_headers_close_the_connection(make_app: Callable[..., Any],
                                           fake: FakeScheduler) -> None:
    server = serve(make_app, fake, header_timeout_s=0.3, keep_alive_s=30)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            data, took = read_all(sock, 5)
        assert data == b"" and took < 2
        # After a response, the next request's headers have the same deadline,
        # even with a long keep-alive and bytes trickling in.
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(5)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            sock.settimeout(0.1)
            closed = False
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":
                try:
                    sock.sendall(bytes([byte]))
                    if sock.recv(1) == b"":
                        closed = True
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed = True
                    break
            assert closed and time.monotonic() - started < 3
        # Headers in time are served, slowly or not.
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            time.sleep(0.1)
            sock.sendall(b"Host: x\r\nConnection: close\r\n\r\n")
            data, _took = read_all(sock, 5)
        assert data.startswith(b"HTTP/1.1 200")
    finally:
        server.__exit__()


def test_in_flight_limit_and_header_size(make_app: Callable[..., Any],
                                         fake: FakeScheduler) -> None:
    fake.token_delay_s = 0.2
    server = serve(make_app, fake, max_connections=2, max_header_bytes=2048)
    try:
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        # A request head still incomplete past the limit is refused (h11 buffers no more).
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 4096)
            data, _took = read_all(sock, 5)
        assert data.startswith(b"HTTP/1.1 400")
        # Idle connections take no request slot...
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
        try:
            time.sleep(0.1)
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        finally:
            for sock in idle:
                sock.close()
        # ...requests in flight do.
        slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        try:
            for sock in slow:
                sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                             str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
            time.sleep(0.1)
            busy = httpx.get(f"{server.url}/health", timeout=5)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        finally:
            for sock in slow:
                sock.close()
        time.sleep(0.3)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    finally:
        server.__exit__()


def test_pending_connections_close_their_own_oldest_first() -> None:
    pending = PendingConnections(max_total=5, max_per_address=3)
    assert [pending.add(name, "flood") for name in ("f1", "f2", "f3")] == [[], [], []]
    assert pending.add("f4", "flood") == ["f1"] and pending.count("flood") == 3
    assert pending.add("a1", "alice") == [] and pending.add("b1", "bob") == []
    # Past the total, the address holding the most loses its oldest.
    assert pending.add("c1", "carol") == ["f2"] and len(pending) == 5
    pending.remove("a1")
    pending.remove("a1")    # idempotent
    assert pending.count("alice") == 0 and len(pending) == 4
    assert pending.add("b1", "bob") == [] and len(pending) == 4   # counted once


def test_half_open_connections_leave_requests_served(make_app: Callable[..., Any],
                                                     fake: FakeScheduler) -> None:
    """300 half-sent request lines from one address, past both the pending cap
    and GATEWAY_MAX_CONNECTIONS: a whole request from the same address is
    still served (before, uvicorn answered 503 past 8 open connections)."""
    server = serve(make_app, fake, max_connections=8, max_pending_per_address=16,
                   max_pending_connections=32)
    flood: list[socket.socket] = []
    try:
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(b"GET / HT")
            flood.append(sock)
        time.sleep(0.2)
        started = time.monotonic()
        reply = httpx.post(f"{server.url}/generate", json={"prompt": "Hi", "max_tokens": 2},
                           timeout=5)
        assert reply.status_code == 200 and time.monotonic() - started < 5
        open_ones = 0
        for sock in flood:
            sock.settimeout(0.001)
            try:
                open_ones += sock.recv(1) != b""
            except TimeoutError:
                open_ones += 1
            except OSError:
                pass
        assert open_ones <= 16     # the flood lost its oldest connections
    finally:
        for sock in flood:
            sock.close()
        server.__exit__()


def test_idle_keep_alive_connections_count_as_waiting(make_app: Callable[..., Any],
                                                      fake: FakeScheduler) -> None:
    """Between keep-alive requests a connection waits for headers again: it counts against the
    cap, and is the first closed when newer ones from its address arrive past it."""
    server = serve(make_app, fake, max_pending_per_address=2, keep_alive_s=30)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as idle:
            idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            idle.settimeout(5)
            assert idle.recv(65536).startswith(b"HTTP/1.1 200")
            newer = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
            try:
                data, took = read_all(idle, 5)       # closed at once, not after 30 s
                assert data == b"" and took < 2
            finally:
                for sock in newer:
                    sock.close()
    finally:
        server.__exit__()
