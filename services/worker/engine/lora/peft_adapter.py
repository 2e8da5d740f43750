"""One LoRA adapter in the PEFT format, read and checked: `adapter_config.json` (r, lora_alpha,
target_modules, use_rslora) and `adapter_model.safetensors` (lora_A [r, in] and lora_B [out, r]
per targeted projection). Only plain LoRA over the attention and MLP projections loads: DoRA,
biases, modules_to_save, fan_in_fan_out, embeddings and the LM head are refused with an error
naming what the adapter asks for. The scale is lora_alpha / r, or lora_alpha / sqrt(r) with
rsLoRA, as peft computes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from common.model_files.peft_config import CONFIG_FILE, WEIGHTS_FILE, AdapterError, file_digest, read_config, scale_of

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


@dataclass(frozen=True)
class LoraWeights:
    a: torch.Tensor          # [r, in]
    b: torch.Tensor          # [out, r]
    scale: float
    b_t: torch.Tensor        # [r, out], contiguous: what the C decode layers read (native_lora.py)


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    digest: str                              # sha256 of the weights file: what the adapter is
    weights: dict[str, LoraWeights]          # full module name (as in model.named_modules()) -> weights

    @property
    def nbytes(self) -> int:
        return sum(2 * w.b.numel() * w.b.element_size() + w.a.numel() * w.a.element_size()
                   for w in self.weights.values())


def load_adapter(name: str, directory: Path, module_shapes: dict[str, tuple[int, int]], max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> LoraAdapter:
    """The adapter in `directory`, its weights checked against `module_shapes` (the full name of
    every projection an adapter may target -> (in_features, out_features)) and `max_rank`."""
    from safetensors.torch import load_file

    config = read_config(directory)
    rank = config["r"]
    if rank > max_rank:
        raise AdapterError(f"{CONFIG_FILE}: r={rank} exceeds MAX_LORA_RANK={max_rank}")
    weights_path = directory / WEIGHTS_FILE
    try:
        tensors = load_file(str(weights_path), device="cpu")
    except Exception as error:  # noqa: BLE001 - any unreadable file is the adapter's fault
        raise AdapterError(f"{WEIGHTS_FILE}: cannot read it ({type(error).__name__})") from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {key[:200]!r} is not a LoRA A/B weight")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    scale = scale_of(config)
    weights = {module: _checked(module, pair, module_shapes, rank, scale, device, dtype)
               for module, pair in parts.items()}
    if not weights:
        raise AdapterError(f"{WEIGHTS_FILE}: no LoRA weights")
    return LoraAdapter(name=name, rank=rank, digest=file_digest(weights_path), weights=weights)


def _checked(module: str, pair: dict[str, torch.Tensor], module_shapes: dict[str, tuple[int, int]], rank: int,
             scale: float, device: torch.device, dtype: torch.dtype) -> LoraWeights:
    shape = module_shapes.get(module)
    if shape is None:
        raise AdapterError(f"{WEIGHTS_FILE}: {module[:200]!r} is not an attention or MLP projection of the model")
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{WEIGHTS_FILE}: {module!r} lacks its lora_A or lora_B weight")
    a, b = pair["A"], pair["B"]
    in_features, out_features = shape
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
        raise AdapterError(f"{WEIGHTS_FILE}: {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                           f"expected ({rank}, {in_features}) and ({out_features}, {rank})")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"{WEIGHTS_FILE}: {module!r} holds non-finite weights")
    b = b.to(device=device, dtype=dtype).contiguous()
    return LoraWeights(a.to(device=device, dtype=dtype).contiguous(), b, scale, b.t().contiguous())
