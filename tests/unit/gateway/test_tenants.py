"""Tenants from API_KEYS and TENANTS_FILE: names, keys, limits, and errors
that name the variable, tenant and field but never a key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.settings.env import SettingsError
from services.gateway.settings import GatewaySettings
from services.gateway.tenancy.tenant_config import load_tenants, parse_api_keys, parse_tenants_document
from services.gateway.tenancy.tenants import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_NAME_SECRET,
    Tenant,
    TenantLimits,
    TenantRegistry,
    derived_name,
)

TOKEN = "internal-token-0123456789"


def test_named_and_bare_keys() -> None:
    keys = parse_api_keys("alice=sk-a, bob=sk-b,sk-bare,padded==,b64pad=")
    assert keys[:2] == [(b"sk-a", "alice"), (b"sk-b", "bob")]
    assert keys[2] == (b"sk-bare", derived_name(b"sk-bare"))
    # base64 padding stays part of a bare key
    assert [key for key, _ in keys[3:]] == [b"padded==", b"b64pad="]
    assert all(name.startswith("key-") and len(name) == 16 for _, name in keys[2:])


def test_derived_names_are_keyed_and_stable() -> None:
    assert derived_name(b"sk-x") == derived_name(b"sk-x", DEFAULT_NAME_SECRET)
    assert derived_name(b"sk-x", b"one") == derived_name(b"sk-x", b"one")
    assert derived_name(b"sk-x", b"one") != derived_name(b"sk-x", b"two")
    assert derived_name(b"sk-x") != derived_name(b"sk-y")
    env = {"API_KEYS": "sk-x", "INTERNAL_TOKEN": TOKEN}
    tenant = GatewaySettings.from_env(env).tenants.authenticate(b"sk-x")
    assert tenant is not None and tenant.name == derived_name(b"sk-x", TOKEN.encode())


@pytest.mark.parametrize("value, message", [
    ("alice=sk a", "entry 1 (tenant 'alice') is invalid"),
    ("ok,k\u00e9y", "entry 2 is invalid: a key is printable ASCII"),
    ("sk-1,sk-1", "entry 2 is invalid: the same key is listed twice"),
    ("a b=sk-1", "invalid tenant name"),
    ("key-abc=sk-1", "kept for bare keys"),
])
def test_bad_api_keys_name_the_entry_not_the_key(value: str, message: str) -> None:
    with pytest.raises(SettingsError, match="API_KEYS") as raised:
        parse_api_keys(value)
    assert message in str(raised.value)
    assert "sk-1" not in str(raised.value) and "k\u00e9y" not in str(raised.value)


def test_one_tenant_may_have_several_keys() -> None:
    registry = load_tenants("alice=old-key,alice=new-key,bob=b-key")
    assert [tenant.name for tenant in registry.tenants] == ["alice", "bob"]
    old, new = registry.authenticate(b"old-key"), registry.authenticate(b"new-key")
    assert old is new and old is not None and old.name == "alice"


def test_authenticate_compares_bytes_and_never_raises() -> None:
    registry = TenantRegistry.from_named_keys({"alice": "sk-a", "bob": "sk-b"})
    assert registry.authenticate(b"sk-b") == Tenant("bob")
    for presented in (None, b"", b"sk-", b"sk-a ", b"\xff\xfe", "sk-é".encode(), b"x" * 10000):
        assert registry.authenticate(presented) is None
    assert TenantRegistry().authenticate(b"sk-a") is None and not TenantRegistry().enabled


def test_repr_shows_names_not_keys() -> None:
    settings = GatewaySettings.from_env({"API_KEYS": "alice=sk-secret-1,sk-secret-2"})
    shown = repr(settings)
    assert "sk-secret" not in shown and "alice" in shown and "key-" in shown


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_tenants_file_in_json_and_yaml(tmp_path: Path) -> None:
    document = {"defaults": {"max_in_flight": 8},
                "tenants": {"alice": {"weight": 2, "max_priority": 5, "max_queued": 3,
                                      "requests_per_s": 2.5},
                            derived_name(b"sk-bare"): {"burst": 7, "requests_per_s": 1}}}
    as_json = write(tmp_path, "tenants.json", json.dumps(document))
    as_yaml = write(tmp_path, "tenants.yaml", """
defaults:
  max_in_flight: 8
tenants:
  alice: {weight: 2, max_priority: 5, max_queued: 3, requests_per_s: 2.5}
  %s: {burst: 7, requests_per_s: 1}
""" % derived_name(b"sk-bare"))
    for path in (as_json, as_yaml):
        registry = load_tenants("alice=sk-a,bob=sk-b,sk-bare", path)
        limits = {tenant.name: tenant.limits for tenant in registry.tenants}
        assert limits["alice"] == TenantLimits(weight=2.0, max_priority=5, max_in_flight=8,
                                               max_queued=3, requests_per_s=2.5, burst=3)
        assert limits["bob"] == TenantLimits(max_in_flight=8)  # the defaults alone
        assert limits[derived_name(b"sk-bare")].burst == 7


def test_budgets_deadlines_and_the_default_in_flight_limit(tmp_path: Path) -> None:
    path = write(tmp_path, "t.yaml", """
tenants:
  alice: {tokens_per_minute: 12000, max_request_s: 120}
  bob: {max_in_flight: null}
""")
    registry = load_tenants("alice=sk-a,bob=sk-b,carol=sk-c", path)
    alice, bob, carol = (registry.tenant(name).limits for name in ("alice", "bob", "carol"))
    assert (alice.tokens_per_minute, alice.max_request_s, alice.max_in_flight) == (12000, 120.0, 64)
    assert bob.max_in_flight is None                   # null: no limit, said explicitly
    assert carol == TenantLimits() and carol.max_in_flight == DEFAULT_MAX_IN_FLIGHT == 64
    # Keys alone, no file: every tenant has the default.
    assert load_tenants("dave=sk-d").tenant("dave").limits.max_in_flight == 64
    unlimited = write(tmp_path, "u.json", json.dumps({"defaults": {"max_in_flight": None}}))
    assert load_tenants("erin=sk-e", unlimited).tenant("erin").limits.max_in_flight is None


@pytest.mark.parametrize("tenants, message", [
    ({"alice": {"weight": 0}}, "tenant 'alice' field 'weight' must be finite and above 0"),
    ({"alice": {"weight": float("nan")}}, "field 'weight' must be finite"),
    ({"alice": {"weight": 10**400}}, "field 'weight' must be finite"),
    ({"alice": {"weight": True}}, "field 'weight' must be a number"),
    ({"alice": {"weight": "2"}}, "field 'weight' must be a number"),
    ({"alice": {"max_priority": 2**40}}, "field 'max_priority' must be between"),
    ({"alice": {"max_in_flight": 0}}, "field 'max_in_flight' must be between 1"),
    ({"alice": {"max_queued": 1.5}}, "field 'max_queued' must be an integer"),
    ({"alice": {"requests_per_s": -1}}, "field 'requests_per_s' must be finite and above 0"),
    ({"alice": {"burst": 3}}, "field 'burst' needs 'requests_per_s'"),
    ({"alice": {"tokens_per_minute": 0}}, "field 'tokens_per_minute' must be between 1"),
    ({"alice": {"tokens_per_minute": 2.5}}, "field 'tokens_per_minute' must be an integer"),
    ({"alice": {"max_request_s": 0}}, "field 'max_request_s' must be finite and above 0"),
    ({"alice": {"max_request_s": "10"}}, "field 'max_request_s' must be a number"),
    ({"alice": {"colour": "red"}}, "tenant 'alice' has unknown fields: colour"),
    ({"alice": [1]}, "tenant 'alice' must be a mapping"),
    ({"carol": {"weight": 1}}, "tenant 'carol' has no key in API_KEYS"),
    ({"bad name": {}}, "'bad name' is not a valid tenant name"),
])
def test_tenants_file_errors_name_the_tenant_and_field(tmp_path: Path, tenants: object,
                                                       message: str) -> None:
    path = write(tmp_path, "t.json", json.dumps({"tenants": tenants}))
    with pytest.raises(SettingsError, match="TENANTS_FILE") as raised:
        load_tenants("alice=sk-a", path)
    assert message in str(raised.value)
    assert "sk-a" not in str(raised.value)


def test_tenants_file_errors_of_the_file_itself(tmp_path: Path) -> None:
    cases = [(write(tmp_path, "bad.json", "{"), "not valid JSON"),
             (write(tmp_path, "bad.yaml", "tenants: [unclosed"), "not valid YAML"),
             (write(tmp_path, "list.json", "[1]"), "must hold a mapping"),
             (write(tmp_path, "extra.json", '{"tenant": {}}'), "unknown top-level keys: tenant"),
             (str(tmp_path / "missing.json"), "cannot be read")]
    for path, message in cases:
        with pytest.raises(SettingsError, match=message):
            load_tenants("alice=sk-a", path)
    with pytest.raises(SettingsError, match="API_KEYS is empty"):
        load_tenants("", write(tmp_path, "ok.json", '{"tenants": {}}'))
    assert parse_tenants_document(None) == (TenantLimits(), {})


def test_settings_read_tenants_and_name_the_variable(tmp_path: Path) -> None:
    path = write(tmp_path, "t.json", json.dumps({"tenants": {"alice": {"weight": 3}}}))
    settings = GatewaySettings.from_env({"API_KEYS": "alice=sk-a", "TENANTS_FILE": path,
                                         "PREFIX_CACHE_SCOPE": "Tenant"})
    tenant = settings.tenants.tenant("alice")
    assert tenant is not None and tenant.limits.weight == 3.0
    assert settings.prefix_cache_scope == "tenant"
    with pytest.raises(SettingsError, match="PREFIX_CACHE_SCOPE"):
        GatewaySettings.from_env({"PREFIX_CACHE_SCOPE": "session"})
    with pytest.raises(SettingsError, match="TENANTS_FILE"):
        GatewaySettings.from_env({"API_KEYS": "bob=sk-b", "TENANTS_FILE": path})


def test_api_keys_file(tmp_path: Path) -> None:
    """Keys from a file, as INTERNAL_TOKEN_FILE gives the token: one a line or
    comma-separated, `#` comment lines; never together with API_KEYS."""
    path = write(tmp_path, "keys", "# the tenants' keys\nalice=sk-alice-1\n\n bob=sk-bob-1, sk-bare-1\n")
    settings = GatewaySettings.from_env({"API_KEYS_FILE": path})
    assert settings.tenants.enabled
    assert settings.tenants.authenticate(b"sk-alice-1").name == "alice"
    assert settings.tenants.authenticate(b"sk-bob-1").name == "bob"
    assert settings.tenants.authenticate(b"sk-bare-1") is not None
    assert settings.tenants.authenticate(b"# the tenants' keys") is None
    with pytest.raises(SettingsError, match="API_KEYS and API_KEYS_FILE"):
        GatewaySettings.from_env({"API_KEYS_FILE": path, "API_KEYS": "carol=sk-c"})
    with pytest.raises(SettingsError, match="API_KEYS_FILE=.*cannot be read"):
        GatewaySettings.from_env({"API_KEYS_FILE": str(tmp_path / "missing")})
    with pytest.raises(SettingsError, match="API_KEYS_FILE=.*no keys"):
        GatewaySettings.from_env({"API_KEYS_FILE": write(tmp_path, "empty", "# none\n\n")})
    bad = write(tmp_path, "bad", "alice=sk-SECRET-1\nalice2=sk-SECRET-1\n")
    with pytest.raises(SettingsError, match="API_KEYS_FILE entry 2") as error:
        GatewaySettings.from_env({"API_KEYS_FILE": bad})
    assert "SECRET" not in str(error.value)
    tenants = write(tmp_path, "t.json", json.dumps({"tenants": {"alice": {"weight": 2}}}))
    keyed = GatewaySettings.from_env({"API_KEYS_FILE": path, "TENANTS_FILE": tenants})
    assert keyed.tenants.tenant("alice").limits.weight == 2.0
