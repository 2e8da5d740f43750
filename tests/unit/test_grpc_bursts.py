"""A burst of calls to an internal service's gRPC server: every call reaches the
service. gRPC core cancels calls at random once ~1,000 wait to be picked up (a burst of
4,096 Generate streams lost two thirds with a bare CANCELLED before the scheduler saw
them); internal servers lift that limit (common/transport/grpc_server.py), their own
admission deciding instead. The server runs in a process of its own, as in a deployment."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fairserve.launcher.stack import free_port

STREAMS = 3000
CONNECTIONS = 4

SERVER = textwrap.dedent("""
    import asyncio, sys
    from common.transport.grpc_server import GrpcServer

    async def main():
        server = GrpcServer([], [], "127.0.0.1", int(sys.argv[1]))
        await server.start()
        print("ready", flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


async def _watch_all(port: int) -> dict[str, int]:
    """Opens STREAMS health Watch streams at once; the outcome of each one's first message."""
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CONNECTIONS)]
    outcomes: dict[str, int] = {}

    async def watch(index: int) -> None:
        call = health_pb2_grpc.HealthStub(channels[index % CONNECTIONS]).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=120)
        try:
            await call.read()
            outcome = "served"
        except grpc.aio.AioRpcError as error:
            outcome = error.code().name
        finally:
            call.cancel()
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    try:
        await asyncio.gather(*(watch(index) for index in range(STREAMS)))
    finally:
        for channel in channels:
            await channel.close()
    return outcomes


def test_a_burst_of_streams_all_reach_an_internal_server() -> None:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        outcomes = asyncio.run(_watch_all(port))
    finally:
        server.kill()
        server.wait()
    assert outcomes == {"served": STREAMS}
