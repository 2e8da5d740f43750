"""Loading a checkpoint into a model class of our own (models/), where one computes it.

`MODEL_IMPL=auto` (the default) loads a Gemma 3 text checkpoint (`Gemma3ForCausalLM`,
gemma3_text.py) into our own classes when the engine runs the direct forward (on CPU, with
`DIRECT_FORWARD=auto`): that forward reads the model's modules and never calls transformers'
forwards, so transformers' modelling stack (~120 MB resident) is never imported. Any other
checkpoint, device or setting, and `MODEL_IMPL=transformers`, load transformers' class as before.

The weights are read from the checkpoint's safetensors files (one, or the shards its index
names) as views of their memory mapping; model.py copies each out and lets its mapped pages
go, as it does for transformers' models.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from services.worker.engine.models.gemma3_text import Gemma3ForCausalLM, GenerationConfig, supports
from services.worker.engine.models.text_config import TextConfig

MODEL_IMPLS = ("auto", "transformers")
ARCHITECTURES = {"Gemma3ForCausalLM": Gemma3ForCausalLM}
INDEX_FILE = "model.safetensors.index.json"


def own_model_class(model_dir: str | Path) -> type[Gemma3ForCausalLM] | None:
    """Our class for the checkpoint in `model_dir`, or None where we have none that computes
    it exactly (another architecture, or a variant our class does not implement)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    return _class_for(TextConfig.read(model_dir), Path(model_dir))


def _class_for(config: TextConfig, model_dir: Path) -> type[Gemma3ForCausalLM] | None:
    names = config.get("architectures") or []
    cls = ARCHITECTURES.get(names[0]) if len(names) == 1 else None
    if cls is None or supports(config) is not None or not _weight_files(model_dir):
        return None
    return cls


def load_own_model(model_dir: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint in `model_dir` in its own class (own_model_class must have named one), its
    weights views of the files' mappings, in `dtype`."""
    model_dir = Path(model_dir)
    config = TextConfig.read(model_dir)
    cls = _class_for(config, model_dir)
    if cls is None:
        raise ValueError(f"{model_dir}: no model class of our own computes this checkpoint")
    model = cls(config, _generation_config(model_dir), device="meta")
    state = _read_weights(model_dir, dtype)
    tied = config.tie_word_embeddings
    if tied:
        state.pop("lm_head.weight", None)
    expected = {name for name, _ in model.named_parameters(remove_duplicate=True)}
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    _no_meta_tensors(model)
    return model


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else []


def _read_weights(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as file:
            for name in file.keys():
                tensor = file.get_tensor(name)
                state[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
    return state


def _generation_config(model_dir: Path) -> GenerationConfig:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return GenerationConfig()
    return GenerationConfig(eos_token_id=json.loads(path.read_text()).get("eos_token_id"))


def _no_meta_tensors(model: torch.nn.Module) -> None:
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"no weight loaded for {left[:5]}")
