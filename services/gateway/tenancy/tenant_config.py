"""API_KEYS (or API_KEYS_FILE), ADMIN_KEYS and TENANTS_FILE into a
TenantRegistry, checked once at start.

API_KEYS is a comma-separated list of `name=key` entries or bare keys (whose
tenant is named by derived_name). API_KEYS_FILE names a file of the same
entries instead (one a line or comma-separated; `#` starts a comment line),
so keys need not sit in the environment; setting both is an error.
ADMIN_KEYS, in the same syntax, gives the operator tenants' keys: valid API
keys like the others, whose tenants are admins (their /stats shows every
tenant); a tenant is either, never both. `admin: true` on a tenant in
TENANTS_FILE makes an API_KEYS tenant an admin.
TENANTS_FILE (JSON, or YAML for .yaml/.yml)
gives tenants' limits:

    defaults:            # optional: every tenant, listed or not
      max_in_flight: 64  # the default anyway (tenants.DEFAULT_MAX_IN_FLIGHT); null: no limit
    tenants:
      alice: {weight: 2, max_priority: 5, max_queued: 8, requests_per_s: 10, burst: 20,
              tokens_per_minute: 100000, max_request_s: 600}
      ops: {admin: true}
      bob: {lora_adapters: [sql-helper, support]}   # the LoRA adapters bob may name

A field given as null has no limit; a field left out takes the defaults' value.
`lora_adapters` (per tenant or in defaults) lists the LoRA adapters a tenant's requests may
name, `"*"` for every one; unset, none (an admin tenant may use every one). Any other
adapter is a 404 to that tenant, as if it did not exist.

Every error names the variable, and the tenant and field when there is one;
no error message ever shows a key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.model_files.lora_paths import NAME_PATTERN
from common.settings.env import SettingsError
from services.gateway.tenancy.tenants import (
    DERIVED_PREFIX,
    TENANT_NAME,
    TenantLimits,
    TenantRegistry,
    derived_name,
)

INT32_MAX = 2**31 - 1
FIELDS = ("weight", "max_priority", "max_in_flight", "max_queued", "requests_per_s", "burst",
          "tokens_per_minute", "max_request_s")
ROLE_FIELDS = ("admin", "lora_adapters")   # not limits: read by parse_admins and parse_adapters
MAX_TOKENS_PER_MINUTE = 2**53


def read_api_keys(inline: str, path: str) -> tuple[str, str]:
    """(the entries, the variable they came from): API_KEYS' value, or the
    entries in API_KEYS_FILE's file; both set is an error naming both."""
    if inline.strip() and path:
        raise SettingsError("API_KEYS and API_KEYS_FILE are both set: use one")
    if not path:
        return inline, "API_KEYS"
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SettingsError(f"API_KEYS_FILE={path!r} cannot be read: "
                            f"{getattr(error, 'strerror', None) or 'not UTF-8 text'}") from None
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    value = ",".join(lines)
    if not value.replace(",", "").strip():
        raise SettingsError(f"API_KEYS_FILE={path!r} is invalid: the file has no keys")
    return value, "API_KEYS_FILE"


def load_tenants(api_keys: str, tenants_file: str = "", secret: bytes = b"",
                 admin_keys: str = "", source: str = "API_KEYS") -> TenantRegistry:
    """The registry of API_KEYS' (or API_KEYS_FILE's: `source`) and ADMIN_KEYS'
    values, with TENANTS_FILE's limits (a path, or empty for none); secret keys
    the bare keys' derived names."""
    keys, admins = _all_keys(api_keys, admin_keys, secret, source)
    if not tenants_file:
        return TenantRegistry(keys, admins=admins)
    if not keys:
        raise SettingsError("TENANTS_FILE is set but API_KEYS is empty (and API_KEYS_FILE "
                            "unset): tenants come from keys")
    document = read_tenants_file(tenants_file)
    defaults, limits = parse_tenants_document(document)
    known = {name for _key, name in keys}
    for name in limits:
        if name not in known:
            raise SettingsError(f"TENANTS_FILE: tenant {name!r} has no key in API_KEYS")
    default_adapters, adapters = parse_adapters(document)
    return TenantRegistry(keys, limits, defaults, admins | parse_admins(document), adapters, default_adapters)


def parse_adapters(document: Any) -> tuple[frozenset[str] | None, dict[str, frozenset[str] | None]]:
    """(the defaults' allowed LoRA adapters, {tenant: its own}) of a tenants file's document:
    a list of adapter names, or "*" (None: every adapter)."""
    if not isinstance(document, Mapping):
        return frozenset(), {}
    defaults = document.get("defaults")
    default = frozenset()
    if isinstance(defaults, Mapping) and "lora_adapters" in defaults:
        default = _adapters(defaults["lora_adapters"], "defaults")
    own: dict[str, frozenset[str] | None] = {}
    for name, entry in (document.get("tenants") or {}).items():
        if isinstance(entry, Mapping) and "lora_adapters" in entry:
            own[name] = _adapters(entry["lora_adapters"], f"tenant {name!r}")
    return default, own


def _adapters(value: Any, where: str) -> frozenset[str] | None:
    if value == "*":
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) and NAME_PATTERN.match(item) for item in value):
        raise SettingsError(f"TENANTS_FILE: {where} field 'lora_adapters' must be a list of adapter names "
                            "or \"*\"")
    return frozenset(value)


def _all_keys(api_keys: str, admin_keys: str, secret: bytes,
              source: str = "API_KEYS") -> tuple[list[tuple[bytes, str]], set[str]]:
    """(every key with its tenant, the ADMIN_KEYS tenants' names)."""
    keys = parse_api_keys(api_keys, secret, source)
    operators = parse_api_keys(admin_keys, secret, "ADMIN_KEYS")
    tenants = {name for _key, name in keys}
    known = {key for key, _name in keys}
    for position, (key, name) in enumerate(operators, start=1):
        if key in known:
            raise SettingsError(f"ADMIN_KEYS entry {position} is invalid: the key is also in "
                                "API_KEYS")
        if name in tenants:
            raise SettingsError(f"ADMIN_KEYS tenant {name!r} is also an API_KEYS tenant: an "
                                "operator tenant has keys of its own (or use admin: true in "
                                "TENANTS_FILE)")
    return keys + operators, {name for _key, name in operators}


def parse_admins(document: Any) -> set[str]:
    """The tenants a tenants file's document marks `admin: true` (never in defaults)."""
    if not isinstance(document, Mapping):
        return set()
    defaults = document.get("defaults")
    if isinstance(defaults, Mapping) and "admin" in defaults:
        raise SettingsError("TENANTS_FILE: 'admin' is set per tenant, never in defaults")
    admins: set[str] = set()
    for name, entry in (document.get("tenants") or {}).items():
        value = entry.get("admin", False) if isinstance(entry, Mapping) else False
        if not isinstance(value, bool):
            raise SettingsError(f"TENANTS_FILE: tenant {name!r} field 'admin' must be true or "
                                f"false, got {value!r}")
        if value:
            admins.add(name)
    return admins


def parse_api_keys(value: str, secret: bytes = b"",
                   variable: str = "API_KEYS") -> list[tuple[bytes, str]]:
    """[(key, tenant name)] of API_KEYS' (or ADMIN_KEYS') comma-separated entries."""
    keys: list[tuple[bytes, str]] = []
    seen: set[bytes] = set()
    entries = [entry.strip() for entry in value.split(",")]
    for position, entry in enumerate((entry for entry in entries if entry), start=1):
        name, key = _split_entry(entry, variable)
        where = f"{variable} entry {position}" + (f" (tenant {name!r})" if name else "")
        if not key or not all(0x21 <= ord(char) <= 0x7E for char in key):
            raise SettingsError(f"{where} is invalid: a key is printable ASCII without spaces")
        raw = key.encode("ascii")
        if raw in seen:
            raise SettingsError(f"{where} is invalid: the same key is listed twice")
        seen.add(raw)
        keys.append((raw, name or derived_name(raw, secret)))
    return keys


def _split_entry(entry: str, variable: str = "API_KEYS") -> tuple[str, str]:
    """`name=key` when what precedes the first `=` is a tenant name and a key
    follows (a key's base64 padding, `abc=` or `abc==`, stays a bare key)."""
    name, sign, key = entry.partition("=")
    name, key = name.strip(), key.strip()
    if not sign or not key or key.startswith("="):
        return "", entry
    if not TENANT_NAME.match(name):
        raise SettingsError(f"{variable} has an invalid tenant name {name[:64]!r}: use letters, "
                            "digits, '.', '_' and '-' (at most 64, starting with a letter or digit)")
    if name.startswith(DERIVED_PREFIX):
        raise SettingsError(f"{variable} tenant name {name!r} is invalid: names starting with "
                            f"{DERIVED_PREFIX!r} are kept for bare keys")
    return name, key


def read_tenants_file(path: str) -> Any:
    """The document in the file: YAML for .yaml/.yml, JSON otherwise."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SettingsError(f"TENANTS_FILE={path!r} cannot be read: {error}") from None
    if file.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise SettingsError(f"TENANTS_FILE={path!r} is not valid YAML: {error}") from None
    try:
        return json.loads(text)
    except ValueError as error:
        raise SettingsError(f"TENANTS_FILE={path!r} is not valid JSON: {error}") from None


def parse_tenants_document(document: Any) -> tuple[TenantLimits, dict[str, TenantLimits]]:
    """(the defaults, {tenant name: limits}) of a tenants file's document."""
    if document is None:
        return TenantLimits(), {}
    if not isinstance(document, Mapping):
        raise SettingsError("TENANTS_FILE must hold a mapping with 'tenants' (and 'defaults')")
    unknown = sorted(str(key) for key in document if key not in ("defaults", "tenants"))
    if unknown:
        raise SettingsError(f"TENANTS_FILE has unknown top-level keys: {', '.join(unknown)} "
                            "(expected 'defaults' and 'tenants')")
    defaults = parse_limits(document.get("defaults"), "defaults", TenantLimits())
    tenants = document.get("tenants") or {}
    if not isinstance(tenants, Mapping):
        raise SettingsError("TENANTS_FILE: 'tenants' must map tenant names to their settings")
    limits: dict[str, TenantLimits] = {}
    for name, entry in tenants.items():
        if not isinstance(name, str) or not TENANT_NAME.match(name):
            raise SettingsError(f"TENANTS_FILE: {str(name)[:64]!r} is not a valid tenant name")
        limits[name] = parse_limits(entry, f"tenant {name!r}", defaults)
    return defaults, limits


def parse_limits(entry: Any, where: str, base: TenantLimits) -> TenantLimits:
    """One tenant's (or the defaults') fields over `base`."""
    if entry is None:
        return base
    if not isinstance(entry, Mapping):
        raise SettingsError(f"TENANTS_FILE: {where} must be a mapping of {', '.join(FIELDS)}")
    unknown = sorted(str(key) for key in entry if key not in FIELDS and key not in ROLE_FIELDS)
    if unknown:
        raise SettingsError(f"TENANTS_FILE: {where} has unknown fields: {', '.join(unknown)} "
                            f"(expected {', '.join(FIELDS)})")
    values = {name: getattr(base, name) for name in FIELDS}
    for name in FIELDS:
        if name in entry:
            values[name] = _field(entry[name], name, where)
    if values["weight"] is None:
        values["weight"] = 1.0
    if values["max_priority"] is None:
        values["max_priority"] = 0
    if values["burst"] is not None and values["requests_per_s"] is None:
        raise SettingsError(f"TENANTS_FILE: {where} field 'burst' needs 'requests_per_s'")
    if values["requests_per_s"] is not None and values["burst"] is None:
        values["burst"] = max(1, math.ceil(values["requests_per_s"]))
    return TenantLimits(**values)


def _field(value: Any, name: str, where: str) -> Any:
    if value is None:
        return None
    if name in ("weight", "requests_per_s", "max_request_s"):
        return _positive_number(value, name, where)
    if name == "max_priority":
        return _integer(value, name, where, -INT32_MAX, INT32_MAX)
    if name == "tokens_per_minute":
        return _integer(value, name, where, 1, MAX_TOKENS_PER_MINUTE)
    return _integer(value, name, where, 1, INT32_MAX)


def _positive_number(value: Any, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingsError(f"TENANTS_FILE: {where} field {name!r} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and number > 0):
        raise SettingsError(f"TENANTS_FILE: {where} field {name!r} must be finite and above 0, "
                            f"got {value!r}")
    return number


def _integer(value: Any, name: str, where: str, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingsError(f"TENANTS_FILE: {where} field {name!r} must be an integer, got {value!r}")
    if not minimum <= value <= maximum:
        raise SettingsError(f"TENANTS_FILE: {where} field {name!r} must be between {minimum} "
                            f"and {maximum}, got {value}")
    return value

