"""Where a LoRA adapter may be read from, and the parsing of LORA_MODULES.

Adapters named at start (`LORA_MODULES=name=path,...`) are the operator's choice and load from
where they are. A path given at runtime (POST /v1/load_lora_adapter) is a client's string: it
must name a directory inside LORA_ROOT once every symlink is resolved, and so must the two files
read from it, so that no request reads a file outside LORA_ROOT (a symlink out of it, `..`, an
absolute path elsewhere are all refused). Errors never echo the resolved path.
"""

from __future__ import annotations

import re
from pathlib import Path

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class AdapterPathError(ValueError):
    """A path or name an adapter cannot be loaded from; the message names the field."""


def check_name(name: str, field: str = "lora_name") -> str:
    if not NAME_PATTERN.match(name or ""):
        raise AdapterPathError(f"{field} must be 1-128 letters, digits, '.', '_', ':' or '-', starting with a "
                               "letter or digit")
    return name


def parse_lora_modules(value: str, variable: str = "LORA_MODULES") -> dict[str, str]:
    """`name=path,name=path` -> {name: path}; a ValueError naming `variable` on a bad entry."""
    modules: dict[str, str] = {}
    for entry in (item.strip() for item in value.split(",")):
        if not entry:
            continue
        name, sep, path = entry.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not path:
            raise AdapterPathError(f"{variable}: entry {entry[:100]!r} is not name=path")
        try:
            check_name(name)
        except AdapterPathError:
            raise AdapterPathError(f"{variable}: adapter name {name[:100]!r} is invalid") from None
        if name in modules:
            raise AdapterPathError(f"{variable}: adapter {name!r} is named twice")
        modules[name] = path
    return modules


def resolve_under_root(path: str, root: str) -> Path:
    """The real directory `path` names (relative paths are taken inside `root`), refused unless
    it and its adapter files are inside `root` after resolving symlinks."""
    if not root:
        raise AdapterPathError("lora_path: runtime adapter paths are off (LORA_ROOT is not set)")
    if not path or "\x00" in path:
        raise AdapterPathError("lora_path: must be a non-empty path")
    real_root = Path(root).resolve(strict=False)
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = real_root / candidate
    try:
        real = candidate.resolve(strict=True)
    except (OSError, RuntimeError):
        raise AdapterPathError("lora_path: no such adapter directory under LORA_ROOT") from None
    if not _inside(real, real_root) or not real.is_dir():
        raise AdapterPathError("lora_path: must name an adapter directory inside LORA_ROOT")
    for name in ADAPTER_FILES:
        try:
            file = (real / name).resolve(strict=True)
        except (OSError, RuntimeError):
            raise AdapterPathError(f"lora_path: the directory holds no {name}") from None
        if not _inside(file, real) or not file.is_file():
            raise AdapterPathError(f"lora_path: {name} must be a file inside the adapter directory")
    return real


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents
