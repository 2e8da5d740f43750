"""The gathered LoRA update on CUDA (the same torch code as on CPU): a mixed batch of the base
model and two adapters in float32 on the device, its greedy tokens those of the merged models
run on the CPU (decode graphs are left for steps without adapter rows). Skipped without a CUDA device."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.lora.registry import LoraConfig
from services.worker.wiring import build_engine
from tests.fixtures.tiny_lora import greedy_mixed, save_random_adapter
from tests.fixtures.tiny_model import build_model
from tests.unit.worker.engine_helpers import CONFIGS, prompt_of

NEW_TOKENS = 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixed_adapters_on_cuda_match_their_merged_models(tmp_path: Path) -> None:
    config = CONFIGS["llama"]()
    merged = {"": build_model(copy.deepcopy(config)),
              "a": save_random_adapter(tmp_path / "a", config, seed=1),
              "b": save_random_adapter(tmp_path / "b", config, seed=2, target_modules=("q_proj", "down_proj"))}
    engine = build_engine(EngineConfig(model_dir="", device="cuda", dtype="float32", num_blocks=256, block_size=4,
                                       model_key="cuda-lora", lora=LoraConfig(
                                           modules={"a": str(tmp_path / "a"), "b": str(tmp_path / "b")})),
                          model=build_model(copy.deepcopy(config)))
    requests = {f"s{i}": (prompt_of(9 + i, i), name) for i, name in enumerate(["", "a", "b", "a", ""])}
    tokens = greedy_mixed(engine, requests, NEW_TOKENS)
    for seq_id, (prompt, name) in requests.items():
        ids = torch.tensor([prompt])
        expected = merged[name].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                         do_sample=False)[0, len(prompt):].tolist()
        assert tokens[seq_id][:len(expected)] == expected, seq_id
