"""Tenant quotas across scheduler shards: what each tenant holds and has spent on the
other shards, so that a tenant spreading its requests over N shards gets its limits
once, not N times.

Each shard reports, per tenant with a quota, its generations in flight and queued
there (a snapshot) and what it charged the tenant's budgets for the requests it
admitted itself (`admitted` requests and `charged_tokens`, cumulative; a shard that
forgot an idle tenant or restarted starts again from zero). Every exchange a shard
takes each peer's latest snapshot as held elsewhere, and charges the growth of the
cumulative figures to its own budgets:

    peer's report:   t0: {a: in flight 2, tokens 300}   t1: {a: in flight 1, tokens 420}
    held elsewhere:      a: 2                              a: 1
    charged here:        (first read: a baseline)          a: 120 tokens

The limits then hold up to one exchange period: within it a tenant can take its limit
on each shard before the others see it, so the overshoot is bounded by what one
exchange period admits. A peer that stops answering holds nothing here (its requests
are resumed on the shards that remain).

Pure: no transport."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.core.fairness.peer_charges import PeerCharges
from services.scheduler.core.types import QuotaUsage, TenantQuota


@dataclass(frozen=True)
class PeerSpend:
    """What a tenant spent on a peer since the last read: charged here too."""
    tenant: str
    quota: TenantQuota
    requests: int
    tokens: int


class PeerHolds:
    def __init__(self) -> None:
        self._holds: dict[str, dict[str, tuple[int, int]]] = {}   # peer -> tenant -> (in flight, queued)
        self._admitted = PeerCharges()
        self._tokens = PeerCharges()

    def note(self, peer: str, usages: Iterable[QuotaUsage]) -> list[PeerSpend]:
        """Takes `peer`'s latest report.

        Args:
            peer: the peer's address.
            usages: every tenant with a quota at the peer.
        Returns:
            each tenant's spending at the peer since its last report (none at the first).
        """
        usages = list(usages)
        self._holds[peer] = {u.tenant: (u.in_flight, u.queued) for u in usages if u.in_flight or u.queued}
        requests = self._admitted.growth(peer, {u.tenant: float(u.admitted) for u in usages})
        tokens = self._tokens.growth(peer, {u.tenant: float(u.charged_tokens) for u in usages})
        return [PeerSpend(u.tenant, u.quota, int(requests.get(u.tenant, 0)), int(tokens.get(u.tenant, 0)))
                for u in usages if u.tenant in requests or u.tenant in tokens]

    def forget(self, peer: str) -> None:
        """The peer stopped answering: what it held is no longer counted."""
        self._holds.pop(peer, None)

    def held(self, tenant: str) -> tuple[int, int]:
        """The tenant's generations (in flight, queued) on the other shards, as last reported."""
        in_flight = queued = 0
        for holds in self._holds.values():
            peer_in_flight, peer_queued = holds.get(tenant, (0, 0))
            in_flight += peer_in_flight
            queued += peer_queued
        return in_flight, queued
