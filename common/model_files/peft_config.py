"""A PEFT LoRA adapter's directory as files: `adapter_config.json` read and checked (only plain
LoRA: no DoRA, biases, modules_to_save, fan_in_fan_out, rank or alpha patterns), its scale
(lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA, as peft computes it), and the digest of
`adapter_model.safetensors`. Shared by the gateway (which checks and names adapters) and the
worker (which loads their weights: services/worker/engine/lora/peft_adapter.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_REFUSED_TRUE = ("use_dora", "fan_in_fan_out")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file or field."""


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise AdapterError(f"{CONFIG_FILE}: cannot read it ({type(error).__name__})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE}: expected a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type {config.get('peft_type')!r} is not LORA")
    for field in _REFUSED_TRUE:
        if config.get(field):
            raise AdapterError(f"{CONFIG_FILE}: {field}=true is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{CONFIG_FILE}: bias={config.get('bias')!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise AdapterError(f"{CONFIG_FILE}: modules_to_save is not supported")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise AdapterError(f"{CONFIG_FILE}: {field} is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{CONFIG_FILE}: r must be a positive integer")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise AdapterError(f"{CONFIG_FILE}: lora_alpha must be a positive number")
    return config


def scale_of(config: dict) -> float:
    rank, alpha = config["r"], float(config["lora_alpha"])
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
