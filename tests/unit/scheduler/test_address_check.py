"""A worker registers only an address of its own host, and a live worker id
keeps its address (address_check.py, registration.py): the rule with fake
network facts, then the two attacks on a real scheduler: a spy re-binding a
live worker's id, and a caller registering an address it does not call from."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc

from common.transport.grpc_server import insecure_channel
from common.transport.peer import IPAddress, peer_host, peer_ip
from services.scheduler.workers.address_check import HostFacts, check_peer_address, is_local_address
from services.scheduler.workers.registration import AddressNotOwned, WorkerIdTaken, check_rebind
from services.scheduler.server import SchedulerServer
from services.scheduler.settings import SchedulerSettings

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.fake_worker_server import FakeWorkerProcess

ip = ipaddress.ip_address
THIS_HOST = {ip("127.0.0.1"), ip("::1"), ip("10.0.0.5")}


def facts(names: dict[str, list[str]] | None = None, local: set | None = None) -> HostFacts:
    async def resolve(host: str) -> list[IPAddress]:
        if host not in (names or {}):
            raise OSError("no such host")
        return [ip(value) for value in (names or {})[host]]
    return HostFacts(resolve=resolve, is_local=lambda address: address in (THIS_HOST if local is None else local))


# ---- peers ----

@pytest.mark.parametrize("peer, address, host", [
    ("ipv4:10.0.0.7:43210", "10.0.0.7", "10.0.0.7"),
    ("ipv6:[::1]:43210", "::1", "::1"),
    ("ipv6:%5B::1%5D:43210", "::1", "::1"),
    ("ipv6:[::ffff:10.0.0.7]:5", "10.0.0.7", "10.0.0.7"),          # IPv4-mapped: read as IPv4
    ("ipv6:[fe80::1%25eth0]:5", "fe80::1", "fe80::1"),
    ("unix:/tmp/socket", None, "unix:/tmp/socket"),
    ("", None, "unknown"),
])
def test_peers_are_read_as_grpc_writes_them(peer: str, address: str | None, host: str) -> None:
    assert peer_ip(peer) == (ip(address) if address else None)
    assert peer_host(peer) == host


# ---- the rule ----

@pytest.mark.parametrize("address, peer", [
    ("10.0.0.7:50061", "ipv4:10.0.0.7:40000"),                 # the caller's own address
    ("[2001:db8::7]:50061", "ipv6:[2001:db8::7]:40000"),
    ("10.0.0.7:50061", "ipv6:[::ffff:10.0.0.7]:40000"),
    ("worker-3:50061", "ipv4:10.0.0.7:40000"),                # a name that resolves to it
    ("127.0.0.1:50061", "ipv6:[::1]:40000"),                   # both on this host
    ("10.0.0.5:50061", "ipv4:127.0.0.1:40000"),
    ("127.0.0.1:50061", "ipv4:10.0.0.5:40000"),
])
async def test_an_address_of_the_callers_host_is_taken(address: str, peer: str) -> None:
    await check_peer_address(address, peer, facts({"worker-3": ["10.0.0.9", "10.0.0.7"]}))


@pytest.mark.parametrize("address, peer, message", [
    ("10.0.0.8:50061", "ipv4:10.0.0.7:40000", "this call comes from 10.0.0.7"),
    ("spy.example:50061", "ipv4:10.0.0.7:40000", "this call comes from 10.0.0.7"),
    ("127.0.0.1:50061", "ipv4:10.0.0.7:40000", "this call comes from 10.0.0.7"),    # dial itself for a remote caller
    ("0.0.0.0:50061", "ipv4:10.0.0.7:40000", "this call comes from 10.0.0.7"),
    ("10.0.0.7:50061", "ipv4:127.0.0.1:40000", "this call comes from 127.0.0.1"),   # a local caller, a remote address
    ("nowhere:50061", "ipv4:10.0.0.7:40000", "'nowhere' does not resolve"),
    ("10.0.0.7:50061", "unix:/tmp/scheduler.sock", "the call does not come over IP"),
])
async def test_any_other_address_is_refused(address: str, peer: str, message: str) -> None:
    with pytest.raises(AddressNotOwned, match=message) as refused:
        await check_peer_address(address, peer, facts({"spy.example": ["203.0.113.9"]}))
    assert f"address {address!r}" in str(refused.value)


def test_this_hosts_addresses() -> None:
    assert is_local_address(ip("127.0.0.1")) and is_local_address(ip("127.0.0.2"))
    assert is_local_address(ip("0.0.0.0"))
    assert not is_local_address(ip("192.0.2.1"))     # TEST-NET-1: never assigned


def test_a_live_id_keeps_its_address() -> None:
    check_rebind("w0", "10.0.0.7:1", None)             # free
    check_rebind("w0", "10.0.0.7:1", "10.0.0.7:1")     # the reconnect of a live worker
    with pytest.raises(WorkerIdTaken, match="worker_id 'w0' is live at another address") as taken:
        check_rebind("w0", "10.0.0.8:1", "10.0.0.7:1")
    assert "10.0.0.7" not in str(taken.value)          # the live worker's address is not told


# ---- the attacks, on a real scheduler ----

@pytest.fixture
async def scheduler() -> AsyncIterator[Callable[..., object]]:
    made: list[tuple[SchedulerServer, list[FakeWorkerProcess]]] = []

    async def make(hosts: HostFacts = HostFacts(), **settings: object) -> tuple[SchedulerServer, list]:
        server = SchedulerServer(SchedulerSettings(port=0, metrics_port=0, kvcache_addr="127.0.0.1:9",
                                                   **settings), hosts=hosts)
        await server.start()
        made.append((server, []))
        return made[-1]
    yield make
    for server, workers in made:
        for worker in workers:
            await worker.stop()
        await server.stop(0)


async def _register(port: int, worker_id: str, address: str) -> tuple[grpc.StatusCode, str]:
    async with insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            await scheduler_pb2_grpc.SchedulerStub(channel).RegisterWorker(
                scheduler_pb2.RegisterWorkerRequest(worker_id=worker_id, address=address), timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code(), error.details()
    return grpc.StatusCode.OK, ""


async def test_a_spy_cannot_rebind_a_live_worker_id(scheduler) -> None:
    server, workers = await scheduler(worker_heartbeat_timeout_s=0.5)
    address = f"127.0.0.1:{server.port}"
    worker = FakeWorkerProcess(FakeEngine(num_blocks=64), "w0", address)
    spy = FakeWorkerProcess(FakeEngine(num_blocks=64), "w0", address)   # answers Info as w0
    workers += [worker, spy]
    await worker.start()
    await spy._server.start()
    code, message = await _register(server.port, "w0", spy.address)
    assert code is grpc.StatusCode.ALREADY_EXISTS and "is live at another address" in message
    assert server.service._links["w0"].address == worker.address
    assert await _register(server.port, "w0", worker.address) == (grpc.StatusCode.OK, "")   # a reconnect
    assert server.service._links["w0"].address == worker.address
    worker.stop_heartbeats()                     # once w0 has expired, its id is free again
    deadline = asyncio.get_running_loop().time() + 10
    while "w0" in server.service._links:
        assert asyncio.get_running_loop().time() < deadline, "w0 never expired"
        await asyncio.sleep(0.05)
    assert await _register(server.port, "w0", spy.address) == (grpc.StatusCode.OK, "")


async def test_an_address_the_caller_does_not_call_from_is_refused(scheduler) -> None:
    """The spy listens on 127.0.0.2, played as another machine (only 127.0.0.1
    counts as this host here); the caller dials from 127.0.0.1."""
    one_host = HostFacts(is_local=lambda address: address == ip("127.0.0.1"))
    server, workers = await scheduler(hosts=one_host)
    spy = FakeWorkerProcess(FakeEngine(num_blocks=64), "spy", f"127.0.0.1:{server.port}", host="127.0.0.2")
    workers.append(spy)
    await spy._server.start()
    code, message = await _register(server.port, "spy", spy.address)
    assert code is grpc.StatusCode.PERMISSION_DENIED
    assert message == (f"address {spy.address!r} is not the caller's: a worker registers an address of the "
                       "host it calls from, and this call comes from 127.0.0.1 (behind NAT or a proxy, set "
                       "REGISTRATION_ADDRESS_CHECK=off)")
    assert server.service._links == {}
    unchecked, more = await scheduler(hosts=one_host, registration_address_check="off")
    assert await _register(unchecked.port, "spy", spy.address) == (grpc.StatusCode.OK, "")   # what it stops
