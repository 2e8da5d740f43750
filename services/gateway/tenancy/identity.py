"""Whom a request is accounted to. With API keys, the tenant the key belongs
to: its name is the fairness client, `user` (else `session_id`) the end user
within it, its weight the client's VTC weight, and its max_priority caps the
priority asked for. Without keys, as before: the client is `session_id`, else
`user`, else "anonymous", with weight 1 and no end user.

The prefix cache scope salts every request's prefix cache (its cache_salt):
`tenant` with the client, so prompts of different tenants never share cached
blocks; `user` with the client and its end user (`user`, else `session_id`),
so neither do two users of one tenant; `global` not at all. Unset (`auto`) it
is `tenant` with API keys and `global` without (cache_scope_for).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.errors import bad_request
from services.gateway.requests.validation import check_text
from services.gateway.tenancy.tenants import Tenant

MAX_IDENTITY_CHARS = 256
ANONYMOUS = "anonymous"
AUTO_SCOPE = "auto"
CACHE_SCOPES = ("global", "tenant", "user")


@dataclass(frozen=True)
class Caller:
    """Who is asking, as the door knows it: the tenant its key names (None
    without API_KEYS) and the prefix cache scope."""
    tenant: Tenant | None = None
    cache_scope: str = "global"


@dataclass(frozen=True)
class Identity:
    client_id: str
    user: str = ""
    session_id: str = ""
    weight: float = 1.0
    cache_salt: str = ""


def check_identity(value: str | None, param: str) -> str:
    """A session id or user: valid Unicode text of at most MAX_IDENTITY_CHARS."""
    if not value:
        return ""
    if len(value) > MAX_IDENTITY_CHARS:
        raise bad_request(f"{param} must be at most {MAX_IDENTITY_CHARS} characters, "
                          f"got {len(value)}.", param, "invalid_value")
    return check_text(value, param)


def resolve_identity(session_id: str | None, user: str | None, caller: Caller) -> Identity:
    session = check_identity(session_id, "session_id")
    end_user = check_identity(user, "user")
    tenant = caller.tenant
    if tenant is None:
        client_id = session or end_user or ANONYMOUS
        identity = Identity(client_id=client_id, session_id=session)
    else:
        identity = Identity(client_id=tenant.name, user=end_user or session, session_id=session,
                            weight=tenant.limits.weight)
    salt = cache_salt(caller.cache_scope, identity.client_id, end_user or session)
    return Identity(identity.client_id, identity.user, identity.session_id, identity.weight, salt)


def cache_scope_for(setting: str, keys_set: bool) -> str:
    """The scope PREFIX_CACHE_SCOPE names; `auto` (unset): `tenant` with API keys, so no tenant
    reads another's prompts through cached_tokens or timings, `global` without keys."""
    if setting != AUTO_SCOPE:
        return setting
    return "tenant" if keys_set else "global"


def cache_salt(scope: str, client_id: str, end_user: str) -> str:
    """The salt of a request of `client_id` and `end_user` under `scope`: "" (global), the
    client (tenant), or the client and the end user (user), length-prefixed so that no other
    pair of client and user gives the same salt."""
    if scope == "tenant":
        return client_id
    if scope == "user":
        return f"user:{len(client_id)}:{client_id}:{end_user}"
    return ""


def cap_priority(priority: int, caller: Caller) -> int:
    """A tenant's requests ask for at most its max_priority; without keys any
    priority stands."""
    if caller.tenant is None:
        return priority
    return min(priority, caller.tenant.limits.max_priority)
