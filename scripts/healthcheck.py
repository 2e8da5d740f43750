"""A container's health probe: exit 0 when the service answers, 1 otherwise.

    python -m scripts.healthcheck gateway     # HTTP GET /health on GATEWAY_PORT
    python -m scripts.healthcheck scheduler   # gRPC health on SCHEDULER_PORT
    python -m scripts.healthcheck worker      # ... WORKER_PORT
    python -m scripts.healthcheck kvcache     # ... KVCACHE_PORT
    python -m scripts.healthcheck proxy       # HTTP GET /health through PROXY_HTTP_PORT

The gRPC probe dials 127.0.0.1 with the service's own internal TLS settings
(GRPC_TLS_*; the certificate is checked against GRPC_TLS_SERVER_NAME). Health
is open without the internal token, so none is sent. Kept light: no torch."""

from __future__ import annotations

import os
import sys
import urllib.request

# name -> (port variable, default port, transport)
SERVICES = {
    "gateway": ("GATEWAY_PORT", 8000, "http"),
    "scheduler": ("SCHEDULER_PORT", 50051, "grpc"),
    "worker": ("WORKER_PORT", 50061, "grpc"),
    "kvcache": ("KVCACHE_PORT", 50071, "grpc"),
    "proxy": ("PROXY_HTTP_PORT", 8000, "http"),  # scripts/tcp_proxy.py: a gateway's /health through it
}


def probe_http(port: int, timeout_s: float) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout_s) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except OSError as error:
        return str(error)


def probe_grpc(port: int, timeout_s: float) -> str | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from common.transport.grpc_server import blocking_channel
    from common.transport.internal_auth import InternalAuth

    auth = InternalAuth.from_env(os.environ, serves=False)
    channel = blocking_channel(f"127.0.0.1:{port}", auth)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in SERVICES:
        print(f"usage: python -m scripts.healthcheck {{{','.join(SERVICES)}}}", file=sys.stderr)
        return 2
    variable, default, transport = SERVICES[argv[0]]
    port = int(os.environ.get(variable) or default)
    timeout_s = float(os.environ.get("HEALTHCHECK_TIMEOUT_S") or 3.0)
    error = (probe_http if transport == "http" else probe_grpc)(port, timeout_s)
    if error is not None:
        print(f"{argv[0]} unhealthy: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
