"""The LoRA adapters the gateway serves beside the base model, and which one a request's
`model` names.

LORA_MODULES' adapters are read at start (a bad one stops the gateway, naming it); with
LORA_RUNTIME_UPDATES=true operators add and remove adapters while serving, from directories
inside LORA_ROOT only (common/lora_paths.py). Each adapter is known by its name and the sha256
of its weights, which its requests carry: their cache salt holds both, so an adapter never
reads the base model's KV, another adapter's, or its own from weights since replaced.

`model` naming one of the base model's served names (SERVED_MODEL_NAME, served_names.py), or
nothing, is the base; an adapter's name is that adapter if the caller may use it
(Tenant.may_use_adapter); anything else, an adapter the caller may not use included, is
UnknownModel (a 404 naming the model, the same whether the name exists or not). An adapter
removed from the catalog is refused to new requests; the ones running finish (their workers
hold its weights).
Pure: no web imports.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from common.block_hash import adapter_id, adapter_salt
from common.model_files.lora_paths import AdapterPathError, check_name, resolve_under_root
from services.gateway.requests.backend import GenerationSpec
from services.gateway.tenancy.tenants import Tenant
from common.model_files.peft_config import WEIGHTS_FILE, AdapterError, file_digest, read_config
from common.settings.env import SettingsError

DIGEST_CHARS = 16     # of the sha256 carried with each request


class UnknownModel(LookupError):
    """`model` names neither a served name of the base model nor an adapter the caller may use."""


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    path: str           # what workers load it from: "" for LORA_MODULES' (they know it), else relative to LORA_ROOT
    digest: str         # the first DIGEST_CHARS hex digits of its weights' sha256
    created: int


class LoraCatalog:
    def __init__(self, base_names: tuple[str, ...], root: str = "", runtime_updates: bool = False) -> None:
        self.base_names = base_names     # the base model's served names, the canonical one first
        self.root = root
        self.runtime_updates = runtime_updates
        self._entries: dict[str, AdapterEntry] = {}

    @classmethod
    def from_modules(cls, base_names: tuple[str, ...], modules: Mapping[str, str], root: str = "",
                     runtime_updates: bool = False) -> LoraCatalog:
        catalog = cls(base_names, root, runtime_updates)
        for name, path in modules.items():
            try:
                catalog._add(name, Path(path), "")
            except (AdapterError, AdapterPathError) as error:
                raise SettingsError(f"LORA_MODULES adapter {name!r}: {error}") from None
        return catalog

    def visible(self, tenant: Tenant | None) -> list[AdapterEntry]:
        return [entry for entry in self._entries.values() if tenant is None or tenant.may_use_adapter(entry.name)]

    def resolve(self, model: str | None, tenant: Tenant | None) -> AdapterEntry | None:
        """The adapter `model` names (None: the base model, named or left out); UnknownModel when
        it names nothing the caller may use."""
        if not model or model in self.base_names:
            return None
        entry = self._entries.get(model)
        if entry is None or (tenant is not None and not tenant.may_use_adapter(entry.name)):
            raise UnknownModel(model)
        return entry

    def load(self, name: str, path: str) -> AdapterEntry:
        """Adds adapter `name` from `path` inside LORA_ROOT (runtime updates); AdapterPathError or
        AdapterError (a 400 naming the field) when it cannot be served."""
        check_name(name)
        if name in self.base_names or name in self._entries:
            raise AdapterPathError(f"lora_name: {name!r} is already served; unload it first")
        real = resolve_under_root(path, self.root)
        relative = str(real.relative_to(Path(self.root).resolve()))
        return self._add(name, real, relative)

    def unload(self, name: str) -> bool:
        return self._entries.pop(name, None) is not None

    def _add(self, name: str, directory: Path, path: str) -> AdapterEntry:
        check_name(name)
        read_config(directory)
        try:
            digest = file_digest(directory / WEIGHTS_FILE)
        except OSError:
            raise AdapterError(f"{WEIGHTS_FILE}: cannot read it") from None
        entry = AdapterEntry(name, path, digest[:DIGEST_CHARS], int(time.time()))
        self._entries[name] = entry
        return entry


def with_adapter(spec: GenerationSpec, adapter: AdapterEntry | None) -> GenerationSpec:
    """`spec` served by `adapter` (None: as it is): named, and salted so that its blocks hash apart."""
    if adapter is None:
        return spec
    return dataclasses.replace(spec, lora_name=adapter.name, lora_path=adapter.path, lora_digest=adapter.digest,
                               cache_salt=adapter_salt(spec.cache_salt, adapter_id(adapter.name, adapter.digest)))
