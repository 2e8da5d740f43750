"""The caller of a gRPC call as gRPC names it (`context.peer()`: `ipv4:10.0.0.5:43210`,
`ipv6:[::1]:43210` or `ipv6:%5B::1%5D:43210`, `unix:/path`): its IP address, for the
scheduler's check of a registered address, and its host, for the refusal logs."""

from __future__ import annotations

import ipaddress
from urllib.parse import unquote

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_PEER_CHARS = 200


def peer_ip(peer: str) -> IPAddress | None:
    """The caller's IP address (an IPv4-mapped IPv6 address as IPv4), or None
    when the peer is not an IP connection (a Unix socket) or cannot be read."""
    scheme, _, rest = (peer or "").partition(":")
    rest = unquote(rest)
    if scheme == "ipv4":
        host = rest.rpartition(":")[0]
    elif scheme == "ipv6":
        host = rest.rpartition(":")[0] if rest.startswith("[") else rest
        host = host.removeprefix("[").removesuffix("]")
    else:
        return None
    return parse_ip(host)


def parse_ip(host: str) -> IPAddress | None:
    """An IP literal (brackets, an IPv6 zone and IPv4 mapping taken off), or None."""
    host = host.removeprefix("[").removesuffix("]").partition("%")[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def peer_host(peer: str) -> str:
    """The caller's host without its port (connections from one host share it),
    or the peer as given, cut short, when it is not an IP connection."""
    address = peer_ip(peer)
    return str(address) if address is not None else (peer or "unknown")[:MAX_PEER_CHARS]
