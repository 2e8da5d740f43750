"""The one published entry point in front of scaled gateways: a TCP proxy that
spreads connections round-robin over every address a name resolves to (under
compose, the service name `gateway` resolves to each replica). Byte-for-byte,
so streamed responses pass through as they come. Names are resolved again for
each connection, so replicas that come and go are followed.

    PROXY_ROUTES=8000=gateway:8000,50050=gateway:50050 python -m scripts.tcp_proxy

PROXY_ROUTES: comma-separated `listen_port=host:port` (that default). gRPC
clients keep one HTTP/2 connection, so they stay with one replica per
connection; HTTP clients are spread per connection.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket

log = logging.getLogger("tcp_proxy")
_turn = itertools.count()


async def _addresses(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        try:
            writer.close()
        except RuntimeError:
            pass


async def _connect(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    addresses = await _addresses(host, port)
    start = next(_turn)
    last: OSError | None = None
    for i in range(len(addresses)):       # the next replica first, then the others
        try:
            return await asyncio.wait_for(asyncio.open_connection(addresses[(start + i) % len(addresses)], port), 5)
        except (OSError, asyncio.TimeoutError) as error:
            last = OSError(str(error))
    raise last or OSError(f"{host} resolves to no address")


def handler(host: str, port: int):
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await _connect(host, port)
        except OSError as error:
            log.warning("no upstream for %s:%d: %s", host, port, error)
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, upstream_writer), _pipe(upstream_reader, client_writer))
    return handle


DEFAULT_ROUTES = "8000=gateway:8000,50050=gateway:50050"


def parse_routes(value: str) -> list[tuple[int, str, int]]:
    """[(listen port, upstream host, upstream port)] of PROXY_ROUTES."""
    routes = []
    for entry in filter(None, (part.strip() for part in value.split(","))):
        listen, _, upstream = entry.partition("=")
        host, _, port = upstream.rpartition(":")
        if not listen.isdigit() or not host or not port.isdigit():
            raise ValueError(f"PROXY_ROUTES entry {entry!r} is invalid: expected listen_port=host:port")
        routes.append((int(listen), host, int(port)))
    if not routes:
        raise ValueError("PROXY_ROUTES is empty")
    return routes


async def serve(routes: list[tuple[int, str, int]]) -> None:
    servers = []
    for listen_port, host, port in routes:
        servers.append(await asyncio.start_server(handler(host, port), "0.0.0.0", listen_port))
        log.info("proxying :%d to every address of %s:%d", listen_port, host, port)
    await asyncio.gather(*(server.serve_forever() for server in servers))


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "info").upper())
    asyncio.run(serve(parse_routes(os.environ.get("PROXY_ROUTES") or DEFAULT_ROUTES)))
