"""The containers' health probe (scripts/healthcheck.py) and the TCP proxy in
front of scaled gateways (scripts/tcp_proxy.py), against local servers."""

from __future__ import annotations

import asyncio
import http.server
import threading

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from scripts import healthcheck, tcp_proxy


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http_port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_http_probe(monkeypatch, http_port: int) -> None:
    monkeypatch.setenv("GATEWAY_PORT", str(http_port))
    assert healthcheck.main(["gateway"]) == 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    closed = server.server_address[1]
    server.server_close()
    monkeypatch.setenv("GATEWAY_PORT", str(closed))
    assert healthcheck.main(["gateway"]) == 1
    assert healthcheck.main(["nothing"]) == 2


def test_grpc_probe_follows_the_serving_status(monkeypatch) -> None:
    async def run() -> list[int]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        monkeypatch.setenv("WORKER_PORT", str(port))
        monkeypatch.setenv("INTERNAL_TOKEN", "x" * 32)   # health needs no token: none is sent
        results = []
        for status in (health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING):
            await servicer.set("", status)
            results.append(await asyncio.to_thread(healthcheck.main, ["worker"]))
        await server.stop(0)
        return results
    assert asyncio.run(run()) == [1, 0]


def test_proxy_routes_and_passes_bytes_through(monkeypatch, http_port: int) -> None:
    assert tcp_proxy.parse_routes(tcp_proxy.DEFAULT_ROUTES) == [(8000, "gateway", 8000), (50050, "gateway", 50050)]
    with pytest.raises(ValueError):
        tcp_proxy.parse_routes("8000=gateway")

    async def run() -> int:
        server = await asyncio.start_server(tcp_proxy.handler(tcp_proxy.Upstream("localhost", http_port)), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        monkeypatch.setenv("PROXY_HTTP_PORT", str(port))
        async with server:
            return await asyncio.to_thread(healthcheck.main, ["proxy"])
    assert asyncio.run(run()) == 0
