"""Per-tenant quotas, held where every request passes, so any number of
gateways give a tenant the same limits as one.

Each request carries its tenant's limits (TenantQuota, from the gateway's
TENANTS_FILE; the latest request's figures are the tenant's). A tenant has:
- generations in flight (waiting or running) and queued (no first token yet),
  each against its maximum;
- a request-rate budget: requests_per_s a second, up to `burst` at once;
- a token budget: tokens_per_minute, refilled at tokens_per_minute / 60 a
  second. A request's prompt is charged when it is admitted, which needs the
  budget to hold it; its output tokens as they are produced, into debt if need
  be: a running generation is never cut off by the budget (max_request_s and
  max_tokens bound it), and the tenant's next request waits until the refill
  has paid the debt and its prompt.
Past a limit the request is refused with the seconds until it may pass
(1 for in flight and queued: nobody knows when a generation ends); a prompt
larger than the whole token budget can never pass (retry_after_s 0).

A resubmission (the gateway lost its scheduler and sends admitted work again)
is never refused and not charged again: it was admitted once, and a tenant
does not pay twice for a scheduler's loss. It still counts in flight.

With scheduler shards (SCHEDULER_PEERS) the limits are the tenant's over all of
them: what it holds on the other shards counts against its in-flight and queued
limits here, and what it spent there is charged to its budgets here
(peer_quotas.py), up to one exchange period behind.

Pure: no transport; the clock is injected.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from services.scheduler.core.budget import Budget
from services.scheduler.core.fairness.peer_quotas import PeerHolds
from services.scheduler.core.types import QuotaUsage, TenantQuota

BUSY_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class QuotaRefusal:
    reason: str          # in_flight | queued | rate | tokens | too_large
    message: str
    retry_after_s: int   # 0: never (too_large)


@dataclass(frozen=True)
class TenantUsage:
    in_flight: int = 0
    queued: int = 0
    refused: int = 0


@dataclass
class _Held:
    """One admitted request's hold on its tenant's counters."""
    tenant: str
    queued: bool
    deadline_s: float | None
    max_request_s: float | None


class _Tenant:
    def __init__(self, quota: TenantQuota, clock: Callable[[], float]) -> None:
        self.quota = quota
        self.in_flight = 0
        self.queued = 0
        self.refused = 0
        self.admitted = 0         # requests charged to the rate budget here, cumulative
        self.charged_tokens = 0   # tokens charged to the token budget here, cumulative
        self.rate: Budget | None = None
        self.tokens: Budget | None = None
        self._clock = clock
        self.reshape(quota)

    def reshape(self, quota: TenantQuota) -> None:
        """Takes new figures; what the budgets saved stays, up to their new sizes."""
        self.quota = quota
        rate = quota.requests_per_s
        self.rate = _budget(self.rate, rate, quota.burst or max(1, math.ceil(rate or 1)), self._clock)
        per_minute = quota.tokens_per_minute
        self.tokens = _budget(self.tokens, per_minute / 60.0 if per_minute else None, per_minute or 1,
                              self._clock)

    @property
    def idle(self) -> bool:
        """Nothing held and every budget full: forgetting it changes nothing."""
        return (self.in_flight == 0 and (self.rate is None or self.rate.full)
                and (self.tokens is None or self.tokens.full))


def _budget(budget: Budget | None, rate_per_s: float | None, capacity: float,
            clock: Callable[[], float]) -> Budget | None:
    if rate_per_s is None:
        return None
    if budget is None:
        return Budget(rate_per_s, capacity, clock)
    budget.reshape(rate_per_s, capacity)
    return budget


class TenantQuotas:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        self._held: dict[str, _Held] = {}
        self._peers = PeerHolds()

    def admit(self, request_id: str, tenant: str, quota: TenantQuota | None, prompt_tokens: int,
              resubmitted: bool = False, started: bool = False) -> QuotaRefusal | None:
        """Counts a new request of `tenant` and charges its prompt; or refuses
        it, spending nothing. `started`: it has streamed tokens already (a
        continuation), so it is not queued. No quota: nothing is counted."""
        if quota is None:
            return None
        state = self._tenant(tenant, quota)
        if not resubmitted:
            refusal = self._check(tenant, state, prompt_tokens)
            if refusal is not None:
                state.refused += 1
                return refusal
            if state.rate is not None:
                state.rate.take(1)
                state.admitted += 1
            if state.tokens is not None:
                state.tokens.charge(prompt_tokens)
                state.charged_tokens += prompt_tokens
        state.in_flight += 1
        state.queued += not started
        limit = quota.max_request_s
        self._held[request_id] = _Held(tenant, not started, self._clock() + limit if limit else None, limit)
        return None

    def produced(self, request_id: str, count: int) -> None:
        """`count` output tokens of the request were streamed: charged, and it is no longer queued."""
        held = self._held.get(request_id)
        if held is None or count <= 0:
            return
        state = self._tenants[held.tenant]
        if state.tokens is not None:
            state.tokens.charge(count)
            state.charged_tokens += count
        if held.queued:
            held.queued = False
            state.queued -= 1

    def release(self, request_id: str) -> None:
        """The request ended whichever way; unknown ids are ignored."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        state = self._tenants[held.tenant]
        state.in_flight -= 1
        state.queued -= held.queued
        self._forget_if_idle(held.tenant, state)

    def _forget_if_idle(self, name: str, state: _Tenant) -> None:
        if state.idle:
            del self._tenants[name]

    # ---- across scheduler shards (peer_quotas.py) ----

    def report(self) -> list[QuotaUsage]:
        """Every tenant with a quota here: what it holds, and what this scheduler charged it."""
        return [QuotaUsage(name, state.quota, state.in_flight, state.queued, state.admitted,
                           state.charged_tokens) for name, state in self._tenants.items()]

    def note_peer(self, peer: str, usages: list[QuotaUsage]) -> None:
        """A peer shard's report: its holds count against the limits here, and what its
        tenants spent there since its last report is charged to their budgets here."""
        for spend in self._peers.note(peer, usages):
            state = self._tenant(spend.tenant, spend.quota)
            if state.rate is not None and spend.requests:
                state.rate.charge(spend.requests)
            if state.tokens is not None and spend.tokens:
                state.tokens.charge(spend.tokens)
            self._forget_if_idle(spend.tenant, state)

    def forget_peer(self, peer: str) -> None:
        """The peer stopped answering: its holds no longer count here."""
        self._peers.forget(peer)

    def overdue(self) -> list[tuple[str, float]]:
        """(request id, its max_request_s) of each request past its deadline."""
        now = self._clock()
        return [(request_id, held.max_request_s or 0.0) for request_id, held in self._held.items()
                if held.deadline_s is not None and now >= held.deadline_s]

    def usage(self, tenant: str) -> TenantUsage:
        state = self._tenants.get(tenant)
        if state is None:
            return TenantUsage()
        return TenantUsage(state.in_flight, state.queued, state.refused)

    def _tenant(self, name: str, quota: TenantQuota) -> _Tenant:
        state = self._tenants.get(name)
        if state is None:
            state = self._tenants[name] = _Tenant(quota, self._clock)
        elif state.quota != quota:
            state.reshape(quota)
        return state

    def _check(self, name: str, state: _Tenant, prompt_tokens: int) -> QuotaRefusal | None:
        quota = state.quota
        in_flight_elsewhere, queued_elsewhere = self._peers.held(name)
        if quota.max_in_flight is not None and state.in_flight + in_flight_elsewhere >= quota.max_in_flight:
            return _busy(name, "in_flight", f"{quota.max_in_flight} generations in flight")
        if quota.max_queued is not None and state.queued + queued_elsewhere >= quota.max_queued:
            return _busy(name, "queued", f"{quota.max_queued} generations waiting for their first token")
        if state.rate is not None:
            wait_s = state.rate.wait_s(1)
            if wait_s > 0:
                return QuotaRefusal("rate", f"Tenant {name!r} is at its limit of {quota.requests_per_s:g} "
                                    f"generations/s (burst {state.rate.capacity:g}); retry later.",
                                    max(1, math.ceil(wait_s)))
        if state.tokens is not None:
            wait_s = state.tokens.wait_s(prompt_tokens)
            if math.isinf(wait_s):
                return QuotaRefusal("too_large", f"The prompt's {prompt_tokens} tokens exceed tenant "
                                    f"{name!r}'s tokens_per_minute of {quota.tokens_per_minute}.", 0)
            if wait_s > 0:
                return QuotaRefusal("tokens", f"Tenant {name!r} is at its limit of {quota.tokens_per_minute} "
                                    "tokens a minute (prompt plus output); retry later.",
                                    max(1, math.ceil(wait_s)))
        return None


def _busy(name: str, reason: str, limit: str) -> QuotaRefusal:
    return QuotaRefusal(reason, f"Tenant {name!r} is at its limit of {limit}; retry later.", BUSY_RETRY_AFTER_S)
