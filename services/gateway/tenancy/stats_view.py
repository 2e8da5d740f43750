"""What GET /stats shows its caller (schema: docs/metrics.md).

Without API keys, and to an operator tenant (ADMIN_KEYS, or `admin: true` in
TENANTS_FILE), everything. To any other tenant only what is its own or is
nobody's: its own gateway numbers (latencies, rates, totals, sessions: from
its TenantTrackers entry), its own entry among the scheduler's clients, and
the shared machine's state (queue lengths, workers, the KV index's sizes and
hit counts). Those shared parts pass through allowlists of fields, so a field
added later to a service's stats stays out of tenants' views until it is
listed here. Pure: no web or gRPC imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.gateway.tenancy.tenants import Tenant

SCHEDULER_SHARED = ("pending", "prefilling", "active", "admitted", "finished", "preemptions",
                    "migrations", "rejections", "holds", "policy", "reserved_kv_tokens")
WORKER_SHARED = ("worker_id", "healthy", "running", "free_blocks", "cached_blocks",
                 "used_blocks", "total_blocks", "last_step_ms", "last_batch_size", "steps",
                 "evictions")
KVCACHE_SHARED = ("lookups", "hits", "lookup_tokens", "hit_tokens", "hit_rate", "nodes",
                  "events", "resyncs", "blocks_by_worker", "backend")


@dataclass(frozen=True)
class StatsScope:
    """Whose numbers a /stats answer may hold: `tenant` None means everyone's."""
    tenant: str | None = None

    @property
    def everything(self) -> bool:
        return self.tenant is None


def stats_scope(tenant: Tenant | None, keyed: bool) -> StatsScope:
    """Everything without keys or for an operator; else the tenant's own (a
    keyed gateway's caller without a tenant sees no one's)."""
    if not keyed or (tenant is not None and tenant.admin):
        return StatsScope()
    return StatsScope(tenant.name if tenant is not None else "")


def scheduler_view(details: Mapping[str, Any] | None, scope: StatsScope) -> dict[str, Any] | None:
    """The scheduler part: for a tenant, the shared fields and its own client entry."""
    if details is None or scope.everything:
        return dict(details) if details is not None else None
    view = _pick(details, SCHEDULER_SHARED)
    workers = details.get("workers")
    if isinstance(workers, list):
        view["workers"] = [_pick(worker, WORKER_SHARED) for worker in workers
                           if isinstance(worker, Mapping)]
    clients = details.get("clients")
    if isinstance(clients, list):
        view["clients"] = [dict(client) for client in clients
                           if isinstance(client, Mapping) and client.get("client_id") == scope.tenant]
    return view


def kvcache_view(stats: Mapping[str, Any] | None, scope: StatsScope) -> dict[str, Any] | None:
    """The kvcache part: for a tenant, the shared fields only."""
    if stats is None or scope.everything:
        return dict(stats) if stats is not None else None
    return _pick(stats, KVCACHE_SHARED)


def dependencies_view(dependencies: Mapping[str, bool]) -> dict[str, bool]:
    """Which services answered: names and booleans, never an error's text."""
    return {str(name): bool(up) for name, up in dependencies.items()}


def _pick(source: Mapping[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    return {name: source[name] for name in fields if name in source}
