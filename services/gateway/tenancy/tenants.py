"""Tenants: who an API key belongs to, and what that tenant may do.

With API_KEYS set, every request is authenticated to a tenant, whose name
(never its key) is the request's fairness identity, and whose limits
(TenantLimits) go with each of its requests to the scheduler, which holds them
for every gateway at once (services/scheduler/core/fairness/quotas.py). A bare key's tenant is named by a keyed
hash of the key (derived_name), stable across replicas that share the secret.

Pure: no web or gRPC imports. Keys are kept as SHA-256 digests, compared in
constant time against every known key, and never shown by a repr.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DERIVED_PREFIX = "key-"
DERIVED_HEX_CHARS = 12
# Keys the derived names' HMAC without INTERNAL_TOKEN: names are then stable
# everywhere, though anyone with a key can compute its name.
DEFAULT_NAME_SECRET = b"fairserve/tenant-name/v1"
# Every keyed tenant's max_in_flight unless TENANTS_FILE says otherwise (null: no limit).
# One tenant then holds at most 1/16 of the default MAX_QUEUE_LEN (1024), so it alone cannot
# fill the queue and get every other tenant refused, while n=8 batches and agents with dozens
# of parallel calls still fit (README, "Tenants").
DEFAULT_MAX_IN_FLIGHT = 64


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's share and limits; None means no limit.

    weight: its share under weighted VTC. max_priority: the highest priority
    its requests may ask for (higher ones are lowered to it). max_in_flight:
    generations running or waiting at once (DEFAULT_MAX_IN_FLIGHT unless set).
    max_queued: generations accepted but without a first token yet.
    requests_per_s and burst: a token bucket over generations started.
    tokens_per_minute: prompt plus output tokens a minute. max_request_s: a
    generation still running this long after it reached the scheduler ends
    with finish_reason "length"."""
    weight: float = 1.0
    max_priority: int = 0
    max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT
    max_queued: int | None = None
    requests_per_s: float | None = None
    burst: int | None = None
    tokens_per_minute: int | None = None
    max_request_s: float | None = None

    @property
    def limited(self) -> bool:
        return (self.max_in_flight is not None or self.max_queued is not None
                or self.requests_per_s is not None)


@dataclass(frozen=True)
class Tenant:
    """admin: an operator tenant (ADMIN_KEYS, or `admin: true` in
    TENANTS_FILE), whose /stats shows every tenant, not only itself."""
    name: str
    limits: TenantLimits = TenantLimits()
    admin: bool = False
    # The LoRA adapters its requests may name (TENANTS_FILE `lora_adapters`); None: every one
    # (an admin, or `"*"`). Any other adapter is a 404, as if it did not exist.
    lora_adapters: frozenset[str] | None = frozenset()

    def may_use_adapter(self, name: str) -> bool:
        return self.admin or self.lora_adapters is None or name in self.lora_adapters


def derived_name(key: bytes, secret: bytes = b"") -> str:
    """The tenant name of a bare key: `key-` and the first hex digits of
    HMAC-SHA256(secret, key)."""
    digest = hmac.new(secret or DEFAULT_NAME_SECRET, key, hashlib.sha256).hexdigest()
    return DERIVED_PREFIX + digest[:DERIVED_HEX_CHARS]


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class TenantRegistry:
    """The keys and their tenants. Empty: the gateway is open (no keys).
    `admins` names the operator tenants."""

    def __init__(self, keys: Iterable[tuple[bytes, str]] = (),
                 limits: Mapping[str, TenantLimits] | None = None,
                 default_limits: TenantLimits = TenantLimits(),
                 admins: Iterable[str] = (),
                 adapters: Mapping[str, frozenset[str] | None] | None = None,
                 default_adapters: frozenset[str] | None = frozenset()) -> None:
        limits = dict(limits or {})
        admins = frozenset(admins)
        adapters = dict(adapters or {})
        self._keys: tuple[tuple[bytes, Tenant], ...] = ()
        tenants: dict[str, Tenant] = {}
        entries = []
        for key, name in keys:
            tenant = tenants.setdefault(
                name, Tenant(name, limits.get(name, default_limits), admin=name in admins,
                             lora_adapters=adapters.get(name, default_adapters)))
            entries.append((_digest(key), tenant))
        self._keys = tuple(entries)
        self._tenants = tenants

    @classmethod
    def from_named_keys(cls, keys: Mapping[str, str],
                        limits: Mapping[str, TenantLimits] | None = None) -> TenantRegistry:
        """{tenant name: key}: a shorthand for tests and tools."""
        return cls(((key.encode("ascii"), name) for name, key in keys.items()), limits)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        return tuple(self._tenants.values())

    def tenant(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def authenticate(self, presented: bytes | None) -> Tenant | None:
        """The tenant of the presented key, or None. Compares the key's digest
        with every known one, without stopping at a match, so the time taken
        tells neither which key matched nor how much of one."""
        if presented is None or not self._keys:
            return None
        digest = _digest(presented)
        found: Tenant | None = None
        for known, tenant in self._keys:
            if hmac.compare_digest(digest, known):
                found = tenant
        return found

    def __repr__(self) -> str:
        names = ", ".join(sorted(self._tenants))
        return f"TenantRegistry(keys={len(self._keys)}, tenants=[{names}])"
