"""Reading settings from the environment, with errors that name the variable.

Each service defines one frozen dataclass of settings and builds it once at
start with `from_env(os.environ)`; nothing reads the environment at import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names the variable."""


class EnvReader:
    """Typed accessors over an environment mapping."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = env

    def _raw(self, name: str) -> str | None:
        value = self._env.get(name)
        if value is None or value.strip() == "":
            return None
        return value.strip()

    def str(self, name: str, default: str) -> str:
        value = self._raw(name)
        return default if value is None else value

    def choice(self, name: str, default: str, choices: Sequence[str]) -> str:
        value = self.str(name, default).lower()
        if value not in choices:
            raise SettingsError(f"{name}={value!r} is invalid: expected one of {', '.join(choices)}")
        return value

    def int(self, name: str, default: int, minimum: int | None = None,
            maximum: int | None = None) -> int:
        value = self._raw(name)
        if value is None:
            return default
        try:
            number = int(value)
        except ValueError:
            raise SettingsError(f"{name}={value!r} is invalid: expected an integer") from None
        self._check_range(name, number, minimum, maximum)
        return number

    def float(self, name: str, default: float, minimum: float | None = None,
              maximum: float | None = None) -> float:
        value = self._raw(name)
        if value is None:
            return default
        try:
            number = float(value)
        except ValueError:
            raise SettingsError(f"{name}={value!r} is invalid: expected a number") from None
        self._check_range(name, number, minimum, maximum)
        return number

    def bool(self, name: str, default: bool) -> bool:
        value = self._raw(name)
        if value is None:
            return default
        lowered = value.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{name}={value!r} is invalid: expected true or false")

    def port(self, name: str, default: int) -> int:
        return self.int(name, default, minimum=0, maximum=65535)

    def list(self, name: str, default: Sequence[str] = ()) -> tuple[str, ...]:
        value = self._raw(name)
        if value is None:
            return tuple(default)
        return tuple(item.strip() for item in value.split(",") if item.strip())

    @staticmethod
    def _check_range(name: str, number: float, minimum: float | None,
                     maximum: float | None) -> None:
        if minimum is not None and number < minimum:
            raise SettingsError(f"{name}={number} is invalid: must be at least {minimum}")
        if maximum is not None and number > maximum:
            raise SettingsError(f"{name}={number} is invalid: must be at most {maximum}")


def split_list(value: str) -> tuple[str, ...]:
    """A comma-separated setting's items, blanks dropped."""
    return tuple(item.strip() for item in value.split(",") if item.strip())


def address_list(name: str, value: str) -> tuple[str, ...]:
    """A comma-separated list of `host:port` addresses; SettingsError names `name` otherwise."""
    addresses = split_list(value)
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SettingsError(f"{name}={value!r} is invalid: {address!r} is not host:port")
    return addresses
