"""Every declared setting as a command-line flag, and the layering of flags, environment and a
`--config` YAML file into the mapping the services read.

A variable `KV_CACHE_NUM_BLOCKS` is the flag `--kv-cache-num-blocks`; a bool is `--x` / `--no-x`.
Precedence, highest first: flags, the environment, the `--config` file, the declared default.
The values stay text until the schema validates them, so a bad value's error names the setting
whichever way it came.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic.fields import FieldInfo

from common.settings.env import SettingsError
from common.settings.schema import SettingsSchema, bounds, type_name

HELP_WIDTH = 100
# Short spellings users of other servers type (vLLM's `--model`), beside the setting's own flag.
ALIASES = {"MODEL_NAME": ("--model",)}


def flag_of(variable: str) -> str:
    """`KV_CACHE_NUM_BLOCKS` -> `--kv-cache-num-blocks`."""
    return "--" + variable.lower().replace("_", "-")


def one_line(description: str | None, limit: int = HELP_WIDTH) -> str:
    """The first clause of a description, for --help (docs/config.md has it whole)."""
    text = " ".join((description or "").split())
    for stop in (". ", "; "):
        cut = text.find(stop)
        if 0 < cut:
            text = text[:cut]
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def describe(variable: str, field: FieldInfo) -> str:
    """`[KV_CACHE_NUM_BLOCKS] int >= 0, default 0: blocks in each worker's pool`."""
    low, high = bounds(field)
    kind = type_name(field)
    if low is not None:
        kind += f" >= {low:g}"
    if high is not None:
        kind += f" <= {high:g}"
    default = field.default
    shown = '""' if default == "" else str(default).lower() if isinstance(default, bool) else default
    return f"[{variable}] {kind}, default {shown}: {one_line(field.description)}"


def variables_of(schemas: Iterable[type[SettingsSchema]]) -> dict[str, tuple[type[SettingsSchema], FieldInfo]]:
    """Variable -> (the first schema declaring it, its field)."""
    out: dict[str, tuple[type[SettingsSchema], FieldInfo]] = {}
    for schema in schemas:
        for variable, field in schema.variables().items():
            out.setdefault(variable, (schema, field))
    return out


def add_setting_flags(parser: argparse.ArgumentParser, schemas: list[type[SettingsSchema]]) -> None:
    """One flag per variable, grouped per schema, advanced settings in a group of their own."""
    seen: set[str] = set()
    for schema in schemas:
        name = schema.service
        group = parser.add_argument_group(f"{name} settings (flag or environment variable)")
        advanced = parser.add_argument_group(f"{name} advanced settings (tuning knobs)")
        for variable, field in schema.variables().items():
            if variable in seen:
                continue
            seen.add(variable)
            target = advanced if variable.lower() in schema.advanced else group
            kwargs: dict[str, Any] = dict(dest=variable, default=None, help=describe(variable, field))
            if field.annotation is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["metavar"] = type_name(field).upper() if field.annotation in (int, float) else "VALUE"
            target.add_argument(flag_of(variable), *ALIASES.get(variable, ()), **kwargs)


def config_file_values(path: str, known: Mapping[str, object]) -> dict[str, str]:
    """A `--config` YAML file's settings as variable -> text. Keys may be written as the
    variable (`KV_CACHE_NUM_BLOCKS`), the flag (`kv-cache-num-blocks`) or the field name.

    Raises:
        SettingsError: the file cannot be read, is not a mapping, or names an unknown setting.
    """
    try:
        loaded = yaml.safe_load(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise SettingsError(f"--config {path!r} cannot be read: {error}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise SettingsError(f"--config {path!r} is invalid: expected a mapping of settings")
    out = {}
    for key, value in loaded.items():
        variable = str(key).lstrip("-").upper().replace("-", "_")
        if variable not in known:
            raise SettingsError(f"--config {path!r}: unknown setting {key!r}")
        out[variable] = _text(value)
    return out


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(_text(item) for item in value)
    return "" if value is None else str(value)


def layered(flags: Mapping[str, object], environ: Mapping[str, str],
            file_values: Mapping[str, str]) -> dict[str, str]:
    """The environment the service reads: the file's values under the environment's, the
    flags' over both."""
    env = {**file_values, **environ}
    for variable, value in flags.items():
        if value is not None:
            env[variable] = _text(value)
    return env
