"""Greedy parity with transformers on the real default model (slow)."""

from __future__ import annotations

import pytest
import torch

from common.model_store import default_cache_dir, default_model_dir, is_prepared
from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu.screen.screen_fbgemm import screening_available
from services.worker.wiring import build_engine
from tests.unit.worker.engine_helpers import Driver

PROMPTS = {
    "capital": "The capital of France is",
    "poem": "Write a short poem about the sea:\n",
    "code": "def fibonacci(n):",
}
NEW_TOKENS = 20


@pytest.mark.slow
@pytest.mark.parametrize("lm_head_screen", ["off", "on"])
def test_real_model_greedy_matches_generate(lm_head_screen: str) -> None:
    model_dir = default_model_dir(default_cache_dir())
    if not is_prepared(model_dir):
        pytest.skip("default model not prepared (run `make prepare-model`)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = {key: tokenizer(text).input_ids for key, text in PROMPTS.items()}
    engine = build_engine(EngineConfig(model_dir=str(model_dir), num_blocks=256, model_key="gemma-3-270m",
                                       lm_head_screen=lm_head_screen))
    # Every projection and the LM head of the dequantized Q4_K_M checkpoint are exact codes.
    assert engine.coded_linears == 7 * engine.model_config.num_hidden_layers + 1
    driver = Driver(engine)
    # The code prompt prefills in chunks while the others already decode.
    got = driver.run(prompts, NEW_TOKENS, chunk={"code": 3})
    screened = sum(step.screened_rows for step in driver.steps)
    assert (screened > 0) == (lm_head_screen == "on" and screening_available())

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for key, prompt in prompts.items():
        input_ids = torch.tensor([prompt])
        expected = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                      max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
        assert got[key][:len(expected)] == expected, (key, tokenizer.decode(got[key]), tokenizer.decode(expected))
