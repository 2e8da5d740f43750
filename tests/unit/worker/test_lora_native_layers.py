"""LoRA in the C decode layers (native_layers.py, native_lora.py) on coded weights: decode steps
with adapter rows, alone or mixed with the base model and other adapters, stay in the one C
call (each row's adapter update added after each projection) and give the merged models'
greedy tokens, as the Python layers do."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from services.worker.engine.lora.registry import LoraConfig
from services.worker.wiring import build_engine
from tests.fixtures.tiny_lora import greedy_mixed, save_random_adapter
from tests.fixtures.tiny_model import build_model
from tests.unit.worker.engine_helpers import CONFIGS, generate, prompt_of
from tests.unit.worker.test_weight_codes import snap_to_codes

NEW_TOKENS = 8
EVERY = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class CountingLayers:
    """Wraps the C layers and counts the steps with adapter rows they ran."""

    def __init__(self, inner) -> None:
        self.inner, self.steps = inner, 0
        self.serves_loras = inner.serves_loras

    def takes(self, meta, rows: int) -> bool:
        return self.inner.takes(meta, rows)

    def __call__(self, hidden, rotary, meta, lora=None, keep=None):
        self.steps += lora is not None
        return self.inner(hidden, rotary, meta, lora, keep=keep)


@pytest.fixture(scope="module", params=[16, 32], ids=["heads16", "heads32"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[torch.nn.Module, Path, dict]:
    """Heads of 16, and of 32, where q, k and v fill whole panels and the C layers read their
    codes joined (coded_groups.py), adding each projection's adapter rows after the one call."""
    config = CONFIGS["gemma3"](head_dim=request.param)
    root = tmp_path_factory.mktemp("native-loras")
    coded = build_model(config)
    assert snap_to_codes(coded) > 0
    merged = {"": coded,
              "qv": save_random_adapter(root / "qv", config, seed=3, base=coded),
              "all": save_random_adapter(root / "all", config, seed=4, r=4, use_rslora=True,
                                         target_modules=EVERY, base=coded)}
    return coded, root, merged


def _engine(coded: torch.nn.Module, root: Path) -> tuple[Engine, CountingLayers]:
    engine = build_engine(EngineConfig(model_dir="", num_blocks=256, block_size=4, model_key="layers",
                                       lora=LoraConfig(modules={"qv": str(root / "qv"), "all": str(root / "all")})),
                          model=copy.deepcopy(coded))
    assert engine.direct_forward == "direct (C decode layers)" and engine.coded_linears > 0
    counting = CountingLayers(engine.forward.direct.native_layers)
    engine.forward.direct.native_layers = counting
    return engine, counting


@pytest.mark.parametrize("names", [["qv"], ["all"], ["", "qv", "all", "qv", ""]], ids=["qv", "all", "mixed"])
def test_adapter_decodes_run_in_the_c_layers_and_stay_exact(setup, names: list[str]) -> None:
    coded, root, merged = setup
    engine, counting = _engine(coded, root)
    requests = {f"s{i}": (prompt_of(9 + i, i), name) for i, name in enumerate(names)}
    tokens = greedy_mixed(engine, requests, NEW_TOKENS)
    assert counting.steps >= NEW_TOKENS - 1           # every decode-only step ran in C
    for seq_id, (prompt, name) in requests.items():
        assert tokens[seq_id][:NEW_TOKENS] == generate(merged[name], prompt, NEW_TOKENS), seq_id
