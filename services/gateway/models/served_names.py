"""The names the base model is served under (SERVED_MODEL_NAME, vLLM's --served-model-name):
what /v1/models lists and what a request's `model` must name.

Several comma-separated names are allowed; the first is the canonical one (responses' `model`,
the `model_name` label of the vLLM-compatible metrics). Unset, the one name is MODEL_NAME's last
path component (a local directory's name, `gemma-3-270m` for the embedded default model), so no
filesystem path is ever shown to clients. Pure: no web imports, no filesystem access.
"""

from __future__ import annotations

import re

from common.model_store import DEFAULT_MODEL_ID
from common.settings.env import SettingsError

VARIABLE = "SERVED_MODEL_NAME"
MAX_NAME_CHARS = 128
# Letters, digits and . _ : - / (Hugging Face ids such as org/model), starting with a letter or digit.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def default_served_name(model_name: str) -> str:
    """MODEL_NAME's last path component (trailing slashes ignored); the default model's when unset."""
    name = (model_name or DEFAULT_MODEL_ID).strip().rstrip("/\\")
    return re.split(r"[/\\]", name)[-1] or DEFAULT_MODEL_ID.rsplit("/", 1)[-1]


def served_names(value: str | None, model_name: str) -> tuple[str, ...]:
    """SERVED_MODEL_NAME read: its names in order, or the default name when unset or blank.
    A SettingsError naming the variable for a malformed or repeated name."""
    names = tuple(item.strip() for item in (value or "").split(",") if item.strip())
    if not names:
        return (default_served_name(model_name),)
    for name in names:
        if not NAME_PATTERN.match(name):
            raise SettingsError(f"{VARIABLE}: {name[:MAX_NAME_CHARS]!r} is invalid: each name must be 1-"
                                f"{MAX_NAME_CHARS} letters, digits, '.', '_', ':', '/' or '-', starting "
                                "with a letter or digit")
    if len(set(names)) != len(names):
        raise SettingsError(f"{VARIABLE}={value!r} is invalid: a name is given twice")
    return names
