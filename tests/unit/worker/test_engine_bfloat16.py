"""The engine in bfloat16 on CPU (pre-packed oneDNN weights where the CPU has them, the
plain kernels otherwise) follows transformers' own bfloat16 forward: every sampled
row's logits agree within bfloat16's precision."""

from __future__ import annotations

import copy

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.wiring import build_engine
from tests.fixtures.tiny_model import build_model
from tests.unit.worker.engine_helpers import CONFIGS, Driver, RecordingSampler, prompt_of

# Logits of the tiny models are O(1); bfloat16 keeps ~3 significant digits, and the
# paged path sums attention and matmuls in other orders than the eager reference.
LOGITS_ATOL = 6e-2


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_bfloat16_logits_follow_the_reference(kind: str, packed: bool) -> None:
    config = CONFIGS[kind]()
    reference = build_model(copy.deepcopy(config)).to(torch.bfloat16).eval()
    model = build_model(copy.deepcopy(config))
    model.load_state_dict(reference.state_dict())
    engine = build_engine(EngineConfig(model_dir="", dtype="bfloat16", num_blocks=64, block_size=4, model_key=kind,
                                       cpu_packed_weights=packed), model=model)
    assert engine.info.dtype == "bfloat16"
    recorder = RecordingSampler(engine.sampler)
    engine.sampler = recorder
    prompts = {"a": prompt_of(13, 1), "b": prompt_of(6, 2), "c": prompt_of(21, 3)}
    Driver(engine).run(prompts, 5, chunk={"c": 8})
    assert len(recorder.rows) == 15
    with torch.no_grad():
        for logits, seen in recorder.rows:
            expected = reference(torch.tensor([seen])).logits[0, -1].float()
            torch.testing.assert_close(logits.float(), expected, atol=LOGITS_ATOL, rtol=0)
