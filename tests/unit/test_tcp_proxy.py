"""The proxy's upstream (scripts/tcp_proxy.py): a failed name lookup falls back
to the last good addresses, replicas take turns, and a connection waits for a
replica that is not accepting yet instead of being dropped; against local
servers on loopback addresses."""

from __future__ import annotations

import asyncio
import socket

import pytest

from scripts import tcp_proxy


class FakeResolver:
    """Answers from a script: a list of addresses, or an exception to raise."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, BaseException):
            raise answer
        return answer


async def _serve(address: str, port: int, name: bytes) -> asyncio.base_events.Server:
    """A replica that answers every connection with its name, then closes it."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(name)
        await writer.drain()
        writer.close()
    return await asyncio.start_server(handle, address, port)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def _read_from(upstream: tcp_proxy.Upstream) -> bytes:
    reader, writer = await upstream.connect()
    data = await reader.read()
    writer.close()
    return data


def test_a_failed_lookup_falls_back_to_the_last_good_addresses() -> None:
    async def run() -> list[bytes]:
        port = _free_port()
        resolver = FakeResolver(["127.0.0.1"], socket.gaierror(-3, "Temporary failure in name resolution"), [])
        upstream = tcp_proxy.Upstream("gateway", port, wait_s=2, resolver=resolver)
        async with await _serve("127.0.0.1", port, b"one"):
            return [await _read_from(upstream) for _ in range(3)]
    assert asyncio.run(run()) == [b"one"] * 3


def test_a_lookup_that_never_answers_gives_up_after_the_wait() -> None:
    async def run() -> None:
        upstream = tcp_proxy.Upstream("gateway", _free_port(), wait_s=0.5,
                                      resolver=FakeResolver(socket.gaierror(-2, "Name or service not known")))
        await upstream.connect()
    with pytest.raises(OSError, match="no replica of gateway.*resolves to no address"):
        asyncio.run(run())


def test_a_lookup_that_hangs_falls_back_after_its_timeout(monkeypatch) -> None:
    monkeypatch.setattr(tcp_proxy, "LOOKUP_TIMEOUT_S", 0.2)

    class Hanging(FakeResolver):
        async def __call__(self, host: str, port: int) -> list[str]:
            if self.calls:
                await asyncio.sleep(30)               # a dropped DNS query: the resolver's own retry
            return await super().__call__(host, port)

    async def run() -> list[bytes]:
        port = _free_port()
        upstream = tcp_proxy.Upstream("gateway", port, wait_s=2, resolver=Hanging(["127.0.0.1"]))
        async with await _serve("127.0.0.1", port, b"one"):
            return [await asyncio.wait_for(_read_from(upstream), 5) for _ in range(2)]
    assert asyncio.run(run()) == [b"one"] * 2


def test_replicas_take_turns() -> None:
    async def run() -> list[bytes]:
        port = _free_port()
        upstream = tcp_proxy.Upstream("gateway", port, wait_s=2, resolver=FakeResolver(["127.0.0.1", "127.0.0.2"]))
        async with await _serve("127.0.0.1", port, b"a"), await _serve("127.0.0.2", port, b"b"):
            return [await _read_from(upstream) for _ in range(4)]
    assert sorted(asyncio.run(run())) == [b"a", b"a", b"b", b"b"]


def test_a_replica_down_is_skipped_for_the_other() -> None:
    async def run() -> list[bytes]:
        port = _free_port()
        upstream = tcp_proxy.Upstream("gateway", port, wait_s=2, resolver=FakeResolver(["127.0.0.1", "127.0.0.2"]))
        async with await _serve("127.0.0.2", port, b"b"):        # nothing listens on 127.0.0.1
            return [await _read_from(upstream) for _ in range(3)]
    assert asyncio.run(run()) == [b"b"] * 3


def test_a_connection_waits_for_a_replica_that_starts_late() -> None:
    async def run() -> bytes:
        port = _free_port()
        upstream = tcp_proxy.Upstream("gateway", port, wait_s=10, resolver=FakeResolver(["127.0.0.1"]))
        pending = asyncio.create_task(_read_from(upstream))
        await asyncio.sleep(0.4)                                 # refused a few times meanwhile
        assert not pending.done()
        async with await _serve("127.0.0.1", port, b"late"):
            return await asyncio.wait_for(pending, 5)
    assert asyncio.run(run()) == b"late"


def test_the_wait_setting_is_validated() -> None:
    assert tcp_proxy.parse_wait(None) == 30.0
    assert tcp_proxy.parse_wait("2.5") == 2.5
    for bad in ("0", "-1", "soon", "99999"):
        with pytest.raises(ValueError, match="PROXY_UPSTREAM_WAIT_S"):
            tcp_proxy.parse_wait(bad)
