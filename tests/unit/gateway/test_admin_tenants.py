"""Operator tenants (ADMIN_KEYS, `admin: true` in TENANTS_FILE) and
METRICS_PORT: how they are read, and errors that name the variable but never
a key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.settings.env import SettingsError
from services.gateway.settings import GatewaySettings
from services.gateway.tenancy.stats_view import stats_scope
from services.gateway.tenancy.tenant_config import load_tenants
from services.gateway.tenancy.tenants import Tenant, derived_name


def test_admin_keys_are_api_keys_of_operator_tenants() -> None:
    registry = load_tenants("alice=sk-a", admin_keys="ops=sk-ops,sk-bare-ops")
    alice, ops = registry.authenticate(b"sk-a"), registry.authenticate(b"sk-ops")
    bare = registry.authenticate(b"sk-bare-ops")
    assert alice is not None and not alice.admin
    assert ops is not None and ops.admin and ops.name == "ops"
    assert bare is not None and bare.admin and bare.name == derived_name(b"sk-bare-ops")


def test_admin_keys_alone_turn_keys_on() -> None:
    registry = load_tenants("", admin_keys="ops=sk-ops")
    assert registry.enabled and registry.authenticate(b"sk-a") is None


@pytest.mark.parametrize(("api_keys", "admin_keys", "message"), [
    ("alice=sk-a", "ops=sk-a", "ADMIN_KEYS entry 1 is invalid: the key is also in API_KEYS"),
    ("alice=sk-a", "alice=sk-b", "ADMIN_KEYS tenant 'alice' is also an API_KEYS tenant"),
    ("alice=sk-a", "ops=sk b", "ADMIN_KEYS entry 1 (tenant 'ops') is invalid"),
    ("alice=sk-a", "key-ops=sk-b", "ADMIN_KEYS tenant name 'key-ops' is invalid"),
    ("alice=sk-a", "ops=sk-b,ops2=sk-b", "ADMIN_KEYS entry 2 (tenant 'ops2') is invalid"),
])
def test_bad_admin_keys_name_the_variable_not_the_key(api_keys: str, admin_keys: str,
                                                      message: str) -> None:
    with pytest.raises(SettingsError) as error:
        load_tenants(api_keys, admin_keys=admin_keys)
    assert message in str(error.value)
    assert "sk-a" not in str(error.value) and "sk-b" not in str(error.value)


def write(tmp_path: Path, document: object) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(document))
    return str(path)


def test_admin_true_in_the_tenants_file(tmp_path: Path) -> None:
    path = write(tmp_path, {"defaults": {"weight": 2},
                            "tenants": {"alice": {"admin": True}, "bob": {"admin": False}}})
    registry = load_tenants("alice=sk-a,bob=sk-b,carol=sk-c", path, admin_keys="ops=sk-o")
    admins = {tenant.name for tenant in registry.tenants if tenant.admin}
    assert admins == {"alice", "ops"}
    alice = registry.tenant("alice")
    assert alice is not None and alice.limits.weight == 2.0   # admin is a role, not a limit


@pytest.mark.parametrize(("document", "message"), [
    ({"defaults": {"admin": True}}, "'admin' is set per tenant, never in defaults"),
    ({"tenants": {"alice": {"admin": "yes"}}}, "tenant 'alice' field 'admin' must be true or false"),
    ({"tenants": {"alice": {"admin": 1}}}, "tenant 'alice' field 'admin' must be true or false"),
])
def test_bad_admin_fields(tmp_path: Path, document: object, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_tenants("alice=sk-a", write(tmp_path, document))


def test_stats_scope() -> None:
    assert stats_scope(None, keyed=False).everything
    assert stats_scope(Tenant("alice"), keyed=False).everything
    assert stats_scope(Tenant("ops", admin=True), keyed=True).everything
    assert stats_scope(Tenant("alice"), keyed=True).tenant == "alice"
    assert stats_scope(None, keyed=True).tenant == ""    # sees no client at all


def test_settings_read_admin_keys_and_metrics_port() -> None:
    settings = GatewaySettings.from_env({"API_KEYS": "alice=sk-a", "ADMIN_KEYS": "ops=sk-o",
                                         "METRICS_PORT": "9100"})
    ops = settings.tenants.tenant("ops")
    assert ops is not None and ops.admin and settings.metrics_port == 9100
    assert GatewaySettings.from_env({}).metrics_port == 0
    assert "sk-o" not in repr(settings)


@pytest.mark.parametrize("env", [{"METRICS_PORT": "8000"}, {"METRICS_PORT": "50050"},
                                 {"METRICS_PORT": "70000"}, {"METRICS_PORT": "x"},
                                 {"METRICS_PORT": "9000", "GATEWAY_PORT": "9000"}])
def test_bad_metrics_port_names_the_variable(env: dict[str, str]) -> None:
    with pytest.raises(SettingsError, match="METRICS_PORT"):
        GatewaySettings.from_env(env)
