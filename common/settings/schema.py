"""The declared settings of a service: one pydantic-settings field per environment variable.

Each service declares its settings once, as a `SettingsSchema` subclass (the service's
`settings_schema.py`): the variable is the field's name in capitals, with its type, default,
bounds and one line of meaning (`description`). From that one declaration come:

- validation, with an error that names the variable (`SettingsError`);
- the command line (`fairserve <service> --help` lists every setting as a flag and a variable);
- `fairserve config` (the effective values, secrets masked);
- docs/config.md (generated, and checked by a test so it cannot drift).

Values are read from a given mapping (the process environment at start, a test's dict, or the
command line's flags and `--config` file layered over the environment), never at import.
Lists are plain strings, comma-separated, as in the environment.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, get_args, get_origin

from pydantic import ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

from common.settings.env import SettingsError

MASK = "********"
_URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@/\s]+@")   # redis://user:pw@host


class _MappingSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, self.case_sensitive, self.env_ignore_empty,
                              self.env_parse_none_str)


class SettingsSchema(BaseSettings):
    """Base of every service's schema. Subclasses declare fields; `read(env)` validates."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", case_sensitive=False,
                                      env_ignore_empty=True)
    service: ClassVar[str] = ""
    # Field names of tuning knobs docs and --help list apart, after the everyday settings.
    advanced: ClassVar[frozenset[str]] = frozenset()
    # Field names whose values are secrets: masked by `fairserve config`.
    secrets: ClassVar[frozenset[str]] = frozenset()

    _environ: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (_MappingSource(settings_cls, cls._environ),)

    @classmethod
    def read(cls, env: Mapping[str, str]) -> typing.Self:
        """Validates the settings in `env` (variable name -> text).

        Raises:
            SettingsError: naming the first invalid variable and why.
        """
        try:
            return cls._build(env)
        except ValidationError as error:
            raise SettingsError(_describe(cls, error, env)) from None

    @classmethod
    def _build(cls, env: Mapping[str, str]) -> typing.Self:
        # A subclass of our own per call keeps the mapping off the shared class (thread-safe).
        reader = type(cls.__name__, (cls,), {"_environ": env, "__module__": cls.__module__})
        return reader()

    @field_validator("*", mode="before")
    @classmethod
    def _normalise(cls, value: Any, info: Any) -> Any:
        if not isinstance(value, str):
            return value
        value = value.strip()
        if get_origin(cls.model_fields[info.field_name].annotation) is Literal:
            value = value.lower()
        return value

    @classmethod
    def variables(cls) -> dict[str, FieldInfo]:
        """Every setting's variable name and its field, in declaration order."""
        own = [name for klass in cls.__mro__ for name in vars(klass).get("__annotations__", {})
               if name in cls.model_fields]
        order = list(dict.fromkeys(own))      # the class's own fields first, then its mixins'
        return {name.upper(): cls.model_fields[name] for name in order}

    def effective(self, mask: bool = True) -> dict[str, Any]:
        """Variable name -> value, secrets masked when set."""
        out = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if mask and name in self.secrets and value not in ("", None):
                value = MASK
            elif mask and isinstance(value, str):
                value = _URL_PASSWORD.sub(r"\1" + MASK + "@", value)
            out[name.upper()] = value
        return out


def type_name(field: FieldInfo) -> str:
    """The type a user writes: int, float, bool, text, or the choices joined by |."""
    annotation = field.annotation
    if get_origin(annotation) is Literal:
        return "|".join(str(choice) for choice in get_args(annotation))
    return {int: "int", float: "float", bool: "bool", str: "text"}.get(annotation, str(annotation))


def bounds(field: FieldInfo) -> tuple[float | None, float | None]:
    """The (minimum, maximum) a numeric field declares (ge/le), None where it has none."""
    low = high = None
    for item in field.metadata:
        low = getattr(item, "ge", low) if getattr(item, "ge", None) is not None else low
        high = getattr(item, "le", high) if getattr(item, "le", None) is not None else high
    return low, high


def _describe(schema: type[SettingsSchema], error: ValidationError, env: Mapping[str, str]) -> str:
    first = error.errors()[0]
    name = str(first["loc"][0]).upper() if first["loc"] else "?"
    value = first.get("input")
    shown = value if not isinstance(value, str) or name.lower() not in schema.secrets else MASK
    ctx = first.get("ctx") or {}
    kind = first["type"]
    if kind == "greater_than_equal":
        why = f"must be at least {ctx['ge']}"
    elif kind == "less_than_equal":
        why = f"must be at most {ctx['le']}"
    elif kind == "literal_error":
        why = "expected one of " + ", ".join(str(c) for c in get_args(schema.model_fields[name.lower()].annotation))
    elif kind in ("int_parsing", "int_from_float"):
        why = "expected an integer"
    elif kind in ("float_parsing", "finite_number"):
        why = "expected a number"
    elif kind == "bool_parsing":
        why = "expected true or false"
    else:
        why = first["msg"]
    if kind in ("greater_than_equal", "less_than_equal"):
        return f"{name}={shown} is invalid: {why}"          # a number: shown as written
    return f"{name}={shown!r} is invalid: {why}"
