"""The adapters resident on one worker: at most MAX_LORAS, loaded on demand and evicted least
recently used among those no running sequence holds.

A sequence names its adapter (name, path, digest). Names in LORA_MODULES load from their
configured path; any other name loads from the path it was sent with, which must lie inside
LORA_ROOT (common/lora_paths.py), and only when LORA_ROOT is set. A digest, when given, must be
the weights file's: an adapter replaced on disk under the same name is refused rather than
served with KV computed for other weights.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.model_files.lora_paths import AdapterPathError, check_name, resolve_under_root
from common.model_files.peft_config import AdapterError
from services.worker.engine.lora.peft_adapter import LoraAdapter, load_adapter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraConfig:
    modules: dict[str, str] = field(default_factory=dict)   # LORA_MODULES: name -> directory
    max_loras: int = 4                                       # MAX_LORAS resident at once
    max_rank: int = 64                                       # MAX_LORA_RANK
    root: str = ""                                           # LORA_ROOT: where runtime paths may point

    @property
    def enabled(self) -> bool:
        return bool(self.modules or self.root)


@dataclass(frozen=True)
class AdapterRef:
    name: str
    path: str = ""
    digest: str = ""


class LoraRegistry:
    def __init__(self, config: LoraConfig, module_shapes: dict[str, tuple[int, int]], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self._shapes = module_shapes
        self._device, self._dtype = device, dtype
        self._resident: OrderedDict[str, LoraAdapter] = OrderedDict()   # least recently used first
        self._holders: dict[str, str] = {}                               # seq_id -> adapter name
        self.loads = 0
        self.evictions = 0

    def preload(self) -> None:
        """Loads LORA_MODULES' first MAX_LORAS adapters (each is checked at start)."""
        for name in list(self.config.modules)[:self.config.max_loras]:
            self._load(AdapterRef(name))

    def resident(self) -> list[str]:
        return list(self._resident)

    def acquire(self, seq_id: str, ref: AdapterRef) -> LoraAdapter:
        """The adapter of `ref`, held for `seq_id` until release(seq_id)."""
        self.release(seq_id)
        adapter = self._resident.get(ref.name)
        if adapter is not None and ref.digest and not adapter.digest.startswith(ref.digest):
            if self._in_use(ref.name):
                raise AdapterError(f"adapter {ref.name!r} is held by running sequences with other weights")
            del self._resident[ref.name]     # replaced on disk: load the weights the request names
            adapter = None
        if adapter is None:
            adapter = self._load(ref)
        self._resident.move_to_end(ref.name)
        self._holders[seq_id] = ref.name
        return adapter

    def release(self, seq_id: str) -> None:
        self._holders.pop(seq_id, None)

    def release_all(self) -> None:
        self._holders.clear()

    def _in_use(self, name: str) -> bool:
        return name in self._holders.values()

    def _load(self, ref: AdapterRef) -> LoraAdapter:
        directory = self._directory(ref)
        held = set(self._holders.values())
        while len(self._resident) >= self.config.max_loras:
            victim = next((name for name in self._resident if name not in held), None)
            if victim is None:
                raise AdapterError(f"MAX_LORAS={self.config.max_loras} adapters are all held by running sequences")
            del self._resident[victim]
            self.evictions += 1
            log.info("LoRA adapter evicted (least recently used)", extra={"adapter": victim})
        adapter = load_adapter(ref.name, directory, self._shapes, self.config.max_rank, self._device, self._dtype)
        if ref.digest and not adapter.digest.startswith(ref.digest):
            raise AdapterError(f"adapter {ref.name!r}: its weights changed since it was loaded at the gateway")
        self._resident[ref.name] = adapter
        self.loads += 1
        log.info("LoRA adapter loaded", extra={"adapter": ref.name, "rank": adapter.rank,
                                               "modules": len(adapter.weights)})
        return adapter

    def _directory(self, ref: AdapterRef) -> Path:
        try:
            check_name(ref.name)
            configured = self.config.modules.get(ref.name)
            return Path(configured) if configured is not None else resolve_under_root(ref.path, self.config.root)
        except AdapterPathError as error:
            raise AdapterError(str(error)) from None
