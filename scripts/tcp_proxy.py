"""The one published entry point in front of scaled gateways: a TCP proxy that
spreads connections round-robin over every address a name resolves to (under
compose, the service name `gateway` resolves to each replica). Byte-for-byte,
so streamed responses pass through as they come. Names are resolved again for
each connection, so replicas that come and go are followed.

    PROXY_ROUTES=8000=gateway:8000,50050=gateway:50050 python -m scripts.tcp_proxy

PROXY_ROUTES: comma-separated `listen_port=host:port` (that default). gRPC
clients keep one HTTP/2 connection, so they stay with one replica per
connection; HTTP clients are spread per connection.

PROXY_UPSTREAM_WAIT_S (default 30): how long a new client connection waits for
some replica to accept before the proxy gives up and closes it. A client
connection is never dropped for a moment's trouble upstream: a failed lookup
(a container network's DNS drops queries while it reloads, e.g. when any
container in the network stops or starts) falls back to the addresses the name
last resolved to, and when no replica accepts the proxy retries, backing off,
until that wait is spent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("tcp_proxy")

Resolver = Callable[[str, int], Awaitable[list[str]]]

LOOKUP_TIMEOUT_S = 2.0       # one name lookup; past it the last good addresses serve
CONNECT_TIMEOUT_S = 5.0      # one connection attempt to one replica
RETRY_DELAYS_S = (0.1, 0.25, 0.5, 1.0)   # between rounds over every address; the last repeats
DEFAULT_WAIT_S = 30.0        # PROXY_UPSTREAM_WAIT_S when unset


def _describe(error: BaseException) -> str:
    """An error's message, or its type where it has none (a timeout)."""
    return str(error) or type(error).__name__


async def resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


class Upstream:
    """One route's upstream name: its addresses, looked up for each connection,
    with the last good answer kept for lookups that fail; the turn for
    round-robin."""

    def __init__(self, host: str, port: int, wait_s: float = DEFAULT_WAIT_S, resolver: Resolver = resolve) -> None:
        self.host, self.port, self.wait_s = host, port, wait_s
        self._resolver = resolver
        self._last_good: list[str] = []
        self._turn = itertools.count()

    async def addresses(self) -> list[str]:
        """The name's addresses now; the last good ones when the lookup fails
        or answers nothing (empty when it never answered)."""
        try:
            found = await asyncio.wait_for(self._resolver(self.host, self.port), LOOKUP_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as error:
            if self._last_good:
                log.warning("lookup of %s failed (%s): using its last addresses %s",
                            self.host, _describe(error), self._last_good)
            return list(self._last_good)
        if found:
            self._last_good = found
        return found or list(self._last_good)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the next replica that accepts, trying the others and
        then retrying every round, backing off, until wait_s is spent."""
        deadline = time.monotonic() + self.wait_s
        last = f"{self.host} resolves to no address"
        round_ = 0
        while True:
            addresses = await self.addresses()
            start = next(self._turn)
            for i in range(len(addresses)):          # the next replica first, then the others
                address = addresses[(start + i) % len(addresses)]
                try:
                    return await asyncio.wait_for(asyncio.open_connection(address, self.port), CONNECT_TIMEOUT_S)
                except (OSError, asyncio.TimeoutError) as error:
                    last = f"{address}:{self.port}: {_describe(error)}"
            pause = RETRY_DELAYS_S[min(round_, len(RETRY_DELAYS_S) - 1)]
            round_ += 1
            if time.monotonic() + pause > deadline:
                raise OSError(f"no replica of {self.host}:{self.port} accepted within {self.wait_s:g} s ({last})")
            await asyncio.sleep(pause)


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


def handler(upstream: Upstream):
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await upstream.connect()
        except OSError as error:
            log.warning("closing a client connection: %s", error)
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


def parse_wait(value: str | None) -> float:
    """PROXY_UPSTREAM_WAIT_S in seconds (DEFAULT_WAIT_S when unset)."""
    if not value:
        return DEFAULT_WAIT_S
    try:
        wait = float(value)
    except ValueError:
        wait = -1.0
    if not 0 < wait <= 3600:
        raise ValueError(f"PROXY_UPSTREAM_WAIT_S={value!r} is invalid: expected seconds in (0, 3600]")
    return wait


async def serve(routes: list[tuple[int, str, int]], wait_s: float) -> None:
    servers = []
    for listen_port, host, port in routes:
        servers.append(await asyncio.start_server(handler(Upstream(host, port, wait_s)), "0.0.0.0", listen_port))
        log.info("proxying :%d to every address of %s:%d", listen_port, host, port)
    await asyncio.gather(*(server.serve_forever() for server in servers))


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "info").upper())
    asyncio.run(serve(parse_routes(os.environ.get("PROXY_ROUTES") or DEFAULT_ROUTES),
                      parse_wait(os.environ.get("PROXY_UPSTREAM_WAIT_S"))))
