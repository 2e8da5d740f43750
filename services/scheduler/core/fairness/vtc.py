"""Weighted, two-level Virtual Token Counter (Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024, with its weighted variant).

Each client has a counter of the service it received divided by its weight:
input_weight x prompt tokens at admission and output_weight per generated
token, both over the client's weight. Counters are in normalized units, so
"lowest counter first" gives a client of weight 2 twice the service of a
client of weight 1 while both are backlogged, and the lift on arrival (to
the smallest counter of the clients waiting, or to the counter of the
client that last left the queue when none waits) needs no weight: idling
earns no credit at any weight.

Within a client, each user (RequestSpec.user; "" is one user like any other)
has a counter charged the same amounts and lifted the same way among the
client's users. It only orders the client's own requests: the client is
chosen first, by its client counter, so users never add up to more than
their client's share.

Invariants:
- A charge adds the same amount to the client's counter and to its user's.
- Counters only grow, except that a forgotten client or user starts again
  from the floor on its next arrival.
- A client's weight is the one its latest request carried, kept within
  [MIN_WEIGHT, MAX_WEIGHT] (anything else non-finite or <= 0 counts as 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from services.scheduler.core.types import ClientCounter

MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e6


def sane_weight(weight: float) -> float:
    """The weight the counters use: 1 for anything not finite and positive,
    else `weight` kept within [MIN_WEIGHT, MAX_WEIGHT] so counters stay finite."""
    if not math.isfinite(weight) or weight <= 0:
        return 1.0
    return min(max(weight, MIN_WEIGHT), MAX_WEIGHT)


class CounterLevel:
    """One level of counters (the clients, or the users of one client)."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.served: dict[str, int] = {}
        self.last_departed: float | None = None

    def get(self, key: str) -> float:
        return self.values.get(key, 0.0)

    def lift(self, key: str, waiting: Iterable[str]) -> None:
        """`key` arrives with nothing waiting: at least the smallest waiting
        counter, or the last departure's when nobody waits."""
        others = [self.get(k) for k in waiting if k != key]
        floor = min(others) if others else self.last_departed
        current = self.values.get(key, 0.0)
        self.values[key] = current if floor is None else max(current, floor)
        self.served.setdefault(key, 0)

    def depart(self, key: str) -> None:
        self.last_departed = self.get(key)

    def charge(self, key: str, cost: float, num_tokens: int) -> None:
        self.values[key] = self.get(key) + cost
        self.served[key] = self.served.get(key, 0) + num_tokens

    def forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.values.pop(key, None)
            self.served.pop(key, None)

    def __len__(self) -> int:
        return len(self.values)


class VirtualTokenCounter:
    def __init__(self, input_weight: float, output_weight: float) -> None:
        self._input_weight = input_weight
        self._output_weight = output_weight
        self._clients = CounterLevel()
        self._users: dict[str, CounterLevel] = {}
        self._weights: dict[str, float] = {}
        self._charged: dict[str, float] = {}   # each client's own charges, cumulative

    # ---- reading ----

    def counter(self, client_id: str) -> float:
        return self._clients.get(client_id)

    def user_counter(self, client_id: str, user: str) -> float:
        users = self._users.get(client_id)
        return users.get(user) if users is not None else 0.0

    def weight(self, client_id: str) -> float:
        return self._weights.get(client_id, 1.0)

    def num_users(self, client_id: str) -> int:
        users = self._users.get(client_id)
        return len(users) if users is not None else 0

    def users(self, client_id: str) -> list[str]:
        """The users of `client_id` with a counter."""
        users = self._users.get(client_id)
        return list(users.values) if users is not None else []

    def snapshot(self) -> tuple[ClientCounter, ...]:
        clients = self._clients
        return tuple(ClientCounter(client_id=c, counter=clients.values[c], served_tokens=clients.served.get(c, 0),
                                   weight=self.weight(c), charged=self._charged.get(c, 0.0))
                     for c in sorted(clients.values))

    def __len__(self) -> int:
        """Clients with a counter."""
        return len(self._clients)

    # ---- arrivals and departures ----

    def set_weight(self, client_id: str, weight: float) -> None:
        self._weights[client_id] = sane_weight(weight)

    def lift_on_arrival(self, client_id: str, waiting_clients: Iterable[str]) -> None:
        self._clients.lift(client_id, waiting_clients)

    def lift_user_on_arrival(self, client_id: str, user: str, waiting_users: Iterable[str]) -> None:
        self._user_level(client_id).lift(user, waiting_users)

    def note_departure(self, client_id: str) -> None:
        """The client's last waiting request left the queue."""
        self._clients.depart(client_id)

    def note_user_departure(self, client_id: str, user: str) -> None:
        """The user's last waiting request left the client's queue."""
        self._user_level(client_id).depart(user)

    # ---- charges ----

    def charge_prompt(self, client_id: str, num_tokens: int, user: str = "") -> None:
        self._charge(client_id, user, self._input_weight * num_tokens, num_tokens)

    def charge_output(self, client_id: str, num_tokens: int = 1, user: str = "") -> None:
        self._charge(client_id, user, self._output_weight * num_tokens, num_tokens)

    def _charge(self, client_id: str, user: str, cost: float, num_tokens: int) -> None:
        normalized = cost / self.weight(client_id)
        self._clients.charge(client_id, normalized, num_tokens)
        self._user_level(client_id).charge(user, normalized, num_tokens)
        self._charged[client_id] = self._charged.get(client_id, 0.0) + normalized

    def charge_elsewhere(self, client_id: str, normalized: float) -> None:
        """Service another scheduler shard gave the client (its counter's growth there,
        already over the weight): added to the client's counter here when it has one (a
        client that arrives later is lifted to the waiting clients' level anyway). Not
        counted as served here, nor reported as this scheduler's own charge."""
        if client_id in self._clients.values and normalized > 0:
            self._clients.values[client_id] += normalized

    # ---- forgetting ----

    def forget(self, client_ids: Iterable[str]) -> None:
        """Drops the clients' counters, weights and users."""
        client_ids = list(client_ids)
        self._clients.forget(client_ids)
        for client_id in client_ids:
            self._users.pop(client_id, None)
            self._weights.pop(client_id, None)
            self._charged.pop(client_id, None)

    def forget_users(self, client_id: str, users: Iterable[str]) -> None:
        level = self._users.get(client_id)
        if level is not None:
            level.forget(users)

    def _user_level(self, client_id: str) -> CounterLevel:
        level = self._users.get(client_id)
        if level is None:
            level = self._users[client_id] = CounterLevel()
        return level
