"""Whom a request is accounted to, with and without API keys."""

from __future__ import annotations

import pytest

from services.gateway.errors import ApiError
from services.gateway.tenancy.identity import Caller, Identity, cache_scope_for, cap_priority, resolve_identity
from services.gateway.settings import GatewaySettings
from services.gateway.tenancy.tenants import TenantRegistry
from services.gateway.tenancy.tenants import Tenant, TenantLimits

ACME = Tenant("acme", TenantLimits(weight=2.5, max_priority=3))


def test_without_keys_nothing_changes() -> None:
    assert resolve_identity("s1", "bob", Caller()) == Identity("s1", "", "s1", 1.0, "")
    assert resolve_identity(None, "bob", Caller()) == Identity("bob")
    assert resolve_identity("", None, Caller()) == Identity("anonymous")
    assert cap_priority(2**31 - 1, Caller()) == 2**31 - 1


def test_with_keys_the_tenant_is_the_client() -> None:
    caller = Caller(ACME)
    assert resolve_identity("s1", "bob", caller) == Identity("acme", "bob", "s1", 2.5)
    assert resolve_identity("s1", None, caller) == Identity("acme", "s1", "s1", 2.5)
    assert resolve_identity(None, None, caller) == Identity("acme", "", "", 2.5)
    assert cap_priority(100, caller) == 3 and cap_priority(-7, caller) == -7
    assert cap_priority(5, Caller(Tenant("plain"))) == 0  # by default clients only lower theirs


def test_tenant_cache_scope_salts_with_the_client() -> None:
    assert resolve_identity("s1", "bob", Caller(ACME, "tenant")).cache_salt == "acme"
    assert resolve_identity(None, "bob", Caller(None, "tenant")).cache_salt == "bob"
    assert resolve_identity(None, None, Caller(None, "tenant")).cache_salt == "anonymous"
    assert resolve_identity("s1", "bob", Caller(ACME, "global")).cache_salt == ""


def test_user_cache_scope_salts_with_the_client_and_its_end_user() -> None:
    salts = {resolve_identity(session, user, Caller(ACME, "user")).cache_salt
             for session, user in [("s1", "bob"), ("s2", "bob"), ("s1", None), ("s2", None), (None, None)]}
    assert len(salts) == 4, "bob's two sessions share, every other end user has its own salt"
    assert resolve_identity("s9", "bob", Caller(ACME, "user")).cache_salt == \
        resolve_identity(None, "bob", Caller(ACME, "user")).cache_salt
    other = Caller(Tenant("other"), "user")
    acme_bob = resolve_identity(None, "bob", Caller(ACME, "user")).cache_salt
    assert resolve_identity(None, "bob", other).cache_salt != acme_bob
    assert all(salt and salt != "acme" for salt in salts)
    # A client id and user that run together differently never make the same salt.
    left = resolve_identity("a:b", "c", Caller(None, "user")).cache_salt
    right = resolve_identity("a", "b:c", Caller(None, "user")).cache_salt
    assert left != right


def test_the_default_scope_isolates_tenants_whenever_keys_are_set() -> None:
    assert cache_scope_for("auto", keys_set=True) == "tenant"
    assert cache_scope_for("auto", keys_set=False) == "global"
    assert cache_scope_for("global", keys_set=True) == "global"   # the operator's opt-in
    assert cache_scope_for("user", keys_set=False) == "user"
    keyed = GatewaySettings.from_env({"API_KEYS": "alice=sk-alice-0123456789"})
    assert keyed.prefix_cache_scope == "auto" and keyed.cache_scope == "tenant"
    assert GatewaySettings.from_env({}).cache_scope == "global"
    assert GatewaySettings.from_env({"API_KEYS": "alice=sk-alice-0123456789",
                                     "PREFIX_CACHE_SCOPE": "global"}).cache_scope == "global"
    assert GatewaySettings.from_env({"PREFIX_CACHE_SCOPE": "user"}).cache_scope == "user"
    assert GatewaySettings(tenants=TenantRegistry.from_named_keys({"a": "k"})).cache_scope == "tenant"


@pytest.mark.parametrize("session_id, user, param", [
    ("\ud800", None, "session_id"), (None, "a\udfffb", "user"),
    ("s" * 257, None, "session_id"), (None, "u" * 257, "user"),
])
def test_bad_identity_strings_are_400(session_id: str | None, user: str | None, param: str) -> None:
    for caller in (Caller(), Caller(ACME)):
        with pytest.raises(ApiError) as raised:
            resolve_identity(session_id, user, caller)
        assert raised.value.status == 400 and raised.value.param == param
    assert resolve_identity("s" * 256, "u" * 256, Caller()).client_id == "s" * 256
