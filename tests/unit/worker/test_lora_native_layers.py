"""LoRA beside the C decode layers (native_layers.py) and the coded linears: a decode step
without adapter rows still runs the C layers, a step with any adapter row runs the Python
layers (whose projections add the adapters' updates), and both equal the merged models."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from common.types import SamplingParams
from services.worker.engine import Engine, EngineConfig, NewSequence, StepBatch, WorkItem
from services.worker.engine.lora.registry import LoraConfig
from tests.fixtures.tiny_lora import save_random_adapter
from tests.fixtures.tiny_model import build_model
from tests.unit.worker.engine_helpers import CONFIGS, generate, prompt_of
from tests.unit.worker.test_native_layers import CountingLayers
from tests.unit.worker.test_weight_codes import snap_to_codes

NEW_TOKENS = 6


def test_adapter_steps_leave_the_c_layers_and_stay_exact(tmp_path: Path) -> None:
    coded = build_model(CONFIGS["gemma3"]())
    assert snap_to_codes(coded) > 0
    merged = save_random_adapter(tmp_path / "qv", CONFIGS["gemma3"](), seed=3, base=coded)
    engine = Engine(EngineConfig(model_dir="", num_blocks=128, block_size=4, model_key="layers",
                                 lora=LoraConfig(modules={"qv": str(tmp_path / "qv")})), model=copy.deepcopy(coded))
    assert engine.direct_forward == "direct (C decode layers)" and engine.coded_linears > 0
    counting = CountingLayers(engine.forward.direct.native_layers)
    engine.forward.direct.native_layers = counting
    prompts = {"base": (prompt_of(9, 1), ""), "lora": (prompt_of(11, 2), "qv")}
    tokens = {}
    for seq_id, (prompt, adapter) in prompts.items():      # each alone: decodes of one kind
        before = counting.steps
        tokens[seq_id] = _run(engine, seq_id, prompt, adapter)
        ran_c_layers = counting.steps - before
        assert ran_c_layers > 0 if not adapter else ran_c_layers == 0
    assert tokens["base"] == generate(coded, prompts["base"][0], NEW_TOKENS)
    assert tokens["lora"] == generate(merged, prompts["lora"][0], NEW_TOKENS)


def _run(engine: Engine, seq_id: str, prompt: list[int], adapter: str) -> list[int]:
    new = [NewSequence(seq_id, tuple(prompt), (), SamplingParams(), lora_name=adapter)]
    tokens: list[int] = []
    while len(tokens) < NEW_TOKENS:
        out = engine.step(StepBatch(new_sequences=new, work=[WorkItem(seq_id, 1024)]))
        new = []
        (result,) = out.results
        assert not result.error
        tokens.extend(result.token_ids)
    engine.step(StepBatch(free_seq_ids=[seq_id]))
    return tokens
