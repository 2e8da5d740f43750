"""Whether the address a worker registers is its own (REGISTRATION_ADDRESS_CHECK=peer,
the default): the scheduler dials that address with every prompt routed to the
worker, so a caller may only name a host it calls from. The address's host
(an IP literal, or a name resolved here) must be the caller's IP address as
the connection shows it (`context.peer()`), IPv4-mapped IPv6 read as IPv4; or
both must be addresses of this host (loopback, unspecified, or one this host
owns), so a worker on the scheduler's machine may advertise 127.0.0.1 while
it dials the scheduler by another local name, or the reverse. A caller behind
NAT or a proxy shows another address: `off` skips the check there.

Only the facts about the network (name resolution, this host's addresses) are
injected (`HostFacts`); the rule itself is pure."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from common.transport.peer import IPAddress, parse_ip, peer_ip

from services.scheduler.workers.registration import AddressNotOwned

ADDRESS_CHECKS = ("peer", "off")
RESOLVE_TIMEOUT_S = 5.0


async def resolve_host(host: str) -> list[IPAddress]:
    """Every address `host` resolves to (the resolver the scheduler dials with)."""
    infos = await asyncio.wait_for(
        asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S)
    return [address for *_, sockaddr in infos if (address := parse_ip(str(sockaddr[0]))) is not None]


def is_local_address(address: IPAddress) -> bool:
    """Loopback, unspecified, or an address of this host (one a socket can bind)."""
    if address.is_loopback or address.is_unspecified:
        return True
    family = socket.AF_INET6 if isinstance(address, ipaddress.IPv6Address) else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(address), 0))
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class HostFacts:
    resolve: Callable[[str], Awaitable[list[IPAddress]]] = resolve_host
    is_local: Callable[[IPAddress], bool] = is_local_address


async def check_peer_address(address: str, peer: str, facts: HostFacts = HostFacts()) -> None:
    """Raises AddressNotOwned unless `address` (a checked host:port) is the caller's."""
    caller = peer_ip(peer)
    if caller is None:
        raise AddressNotOwned(f"address {address!r} cannot be checked: the call does not come over IP; "
                              "set REGISTRATION_ADDRESS_CHECK=off to allow it")
    host = address.rpartition(":")[0]
    literal = parse_ip(host)
    if literal is not None:
        candidates = [literal]
    else:
        try:
            candidates = await facts.resolve(host)
        except (OSError, asyncio.TimeoutError, UnicodeError):
            candidates = []
        if not candidates:
            raise AddressNotOwned(f"address {address!r} is not the caller's: {host!r} does not resolve")
    if not any(_same_host(candidate, caller, facts.is_local) for candidate in candidates):
        raise AddressNotOwned(
            f"address {address!r} is not the caller's: a worker registers an address of the host it "
            f"calls from, and this call comes from {caller} (behind NAT or a proxy, set "
            "REGISTRATION_ADDRESS_CHECK=off)")


def _same_host(candidate: IPAddress, caller: IPAddress, is_local: Callable[[IPAddress], bool]) -> bool:
    if candidate == caller:
        return True
    return is_local(candidate) and is_local(caller)
