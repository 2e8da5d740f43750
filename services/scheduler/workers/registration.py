"""What a worker says about itself when it registers, checked before the
scheduler dials it and before any step is planned for it: its id, the address
to dial, and the pool and model figures of its Info, and that a live worker id
keeps its address. Each check raises `RegistrationError` with a message that
names the field. Whether the address is the caller's own: address_check.py."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from common.worker_ids import MAX_WORKER_ID_LENGTH, WORKER_ID

_HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_PORT = re.compile(r"[0-9]{1,5}")
MAX_HOSTNAME_LENGTH = 253


class RegistrationError(ValueError):
    """A registration field is invalid; the message names it."""


class AddressNotOwned(RegistrationError):
    """The address is not the caller's own (address_check.py)."""


class WorkerIdTaken(RegistrationError):
    """The worker id is live at another address."""


@dataclass(frozen=True)
class WorkerFigures:
    """The figures of a worker's Info that planning depends on."""

    worker_id: str
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int


def check_worker_id(worker_id: str) -> None:
    if not worker_id:
        raise RegistrationError("worker_id is required")
    if len(worker_id) > MAX_WORKER_ID_LENGTH:
        raise RegistrationError(f"worker_id is too long: {len(worker_id)} characters, "
                                f"at most {MAX_WORKER_ID_LENGTH}")
    if not WORKER_ID.fullmatch(worker_id):
        raise RegistrationError(f"worker_id {worker_id!r} is invalid: letters, digits, '.', '_' and '-' "
                                "only, starting with a letter or digit")


def check_address(address: str) -> None:
    """`host:port`: a host name, an IPv4 address or a bracketed IPv6 address,
    and a port from 1 to 65535 (no scheme, path or Unix socket)."""
    if not address:
        raise RegistrationError("address is required")
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        raise RegistrationError(f"address {address[:300]!r} is invalid: expected host:port")
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        raise RegistrationError(f"address {address[:300]!r} is invalid: the port must be 1-65535")
    if not _valid_host(host):
        raise RegistrationError(f"address {address[:300]!r} is invalid: {host[:256]!r} is not a host name "
                                "or IP address")


def _valid_host(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    if len(host) > MAX_HOSTNAME_LENGTH:
        return False
    labels = host.removesuffix(".").split(".")
    if all(label.isdigit() for label in labels):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
        return True
    return all(_HOST_LABEL.fullmatch(label) for label in labels)


def check_worker_figures(figures: WorkerFigures, worker_id: str) -> None:
    """The worker's Info: positive pool and model sizes, and the id it was
    registered under (an empty id in the Info says nothing)."""
    if figures.worker_id and figures.worker_id != worker_id:
        raise RegistrationError(f"worker_id {worker_id!r} does not match the worker's Info, "
                                f"which says {figures.worker_id[:MAX_WORKER_ID_LENGTH]!r}")
    for name in ("block_size", "num_blocks", "max_model_len", "vocab_size"):
        value = getattr(figures, name)
        if value <= 0:
            raise RegistrationError(f"worker info {name} must be positive, got {value}")


def check_registration(worker_id: str, address: str) -> None:
    check_worker_id(worker_id)
    check_address(address)


def check_rebind(worker_id: str, address: str, live_address: str | None) -> None:
    """A live worker id is never bound to another address: registering it again
    at the same address is a reconnect; at another, only once it has left or
    stopped heartbeating (its old address is not told)."""
    if live_address is not None and live_address != address:
        raise WorkerIdTaken(f"worker_id {worker_id!r} is live at another address: a live worker's address "
                            "never changes (it may register at a new one once it has left or stopped "
                            "heartbeating for WORKER_HEARTBEAT_TIMEOUT_S)")
