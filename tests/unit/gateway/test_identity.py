"""Whom a request is accounted to, with and without API keys."""

from __future__ import annotations

import pytest

from services.gateway.errors import ApiError
from services.gateway.identity import Caller, Identity, cap_priority, resolve_identity
from services.gateway.tenants import Tenant, TenantLimits

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
