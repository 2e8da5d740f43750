"""Fairness across scheduler shards: how much each client's counter grew on the other
shards since the last exchange.

Each shard reports, per client, what it has charged the client's counter for the
requests it served itself (`charged`, cumulative; docs/scaling.md). A shard adds the
growth of every peer's figure to its own counters, so a tenant served on several shards
is ordered by its service on all of them, up to one exchange period behind:

    peer's charged:   t0: {a: 10}   t1: {a: 25, b: 4}   t2: {a: 3}     (a forgotten, then back)
    growth read:          (first read: a baseline)  {a: 15, b: 4}   {a: 3}

A peer's figure that went down (the peer forgot an idle client, or restarted) counts
from zero again."""

from __future__ import annotations

from collections.abc import Mapping


class PeerCharges:
    def __init__(self) -> None:
        self._last: dict[str, dict[str, float]] = {}

    def growth(self, peer: str, charged: Mapping[str, float]) -> dict[str, float]:
        """The growth of `peer`'s charges since its last read (nothing at its first read).

        Args:
            peer: the peer's address.
            charged: client id -> the peer's cumulative own charges, as its stats give them.
        Returns:
            client id -> growth, for the clients that grew.
        """
        last = self._last.get(peer)
        self._last[peer] = dict(charged)
        if last is None:
            return {}
        grown: dict[str, float] = {}
        for client_id, value in charged.items():
            before = last.get(client_id, 0.0)
            delta = value - before if value >= before else value
            if delta > 0:
                grown[client_id] = delta
        return grown
