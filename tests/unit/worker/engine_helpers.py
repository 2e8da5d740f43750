"""Shared helpers for engine tests: tiny models, a step driver, reference generation."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from common.types import SamplingParams
from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from common.step import NewSequence, StepBatch, StepOutput, WorkItem
from services.worker.engine.sampling.sampler import SampleRequest, Sampler
from services.worker.wiring import build_engine
from tests.fixtures.tiny_model import build_model, gemma3_config, llama_config



def gemma4_config(vocab_size: int = 384, **overrides):
    """Gemma 4 text in its E2B/E4B shape, shrunk: per-layer embeddings, the last layers
    reading the KV of earlier ones, wider heads on global layers, proportional RoPE there."""
    from transformers import Gemma4TextConfig

    sliding, full = "sliding_attention", "full_attention"
    values = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
                  sliding_window=8, layer_types=[sliding, sliding, full, sliding, sliding, full],
                  num_kv_shared_layers=3, hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab_size,
                  use_double_wide_mlp=True, final_logit_softcapping=30.0, max_position_embeddings=1024,
                  pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True)
    values.update(overrides)
    return Gemma4TextConfig(**values)


def gemma4_k_eq_v_config(vocab_size: int = 384):
    """Gemma 4 variant whose global layers use the keys as values."""
    return gemma4_config(vocab_size, attention_k_eq_v=True)


def qwen3_config(vocab_size: int = 384):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                       pad_token_id=0, eos_token_id=1, bos_token_id=2)


def qwen2_sliding_config(vocab_size: int = 384):
    """Qwen2 with its later layers windowed (layer_types mixes full and sliding)."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                       max_window_layers=1, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1,
                       bos_token_id=2)


CONFIGS = {"gemma3": gemma3_config, "llama": llama_config, "gemma4": gemma4_config,
           "gemma4_k_eq_v": gemma4_k_eq_v_config, "qwen3": qwen3_config, "qwen2_sliding": qwen2_sliding_config}


def reference_model(kind: str) -> torch.nn.Module:
    return build_model(CONFIGS[kind]())


def make_engine(kind: str, num_blocks: int = 128, block_size: int = 4, **config) -> Engine:
    # A separate config object: the engine switches its model's attention implementation.
    model = build_model(copy.deepcopy(CONFIGS[kind]()))
    return build_engine(EngineConfig(model_dir="", num_blocks=num_blocks, block_size=block_size,
                                     model_key=kind, **config), model=model)


def generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy reference tokens (it may stop early on EOS)."""
    input_ids = torch.tensor([prompt])
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                            max_new_tokens=max_new_tokens, do_sample=False)
    return output[0, len(prompt):].tolist()


def assert_greedy_matches(reference: torch.nn.Module, prompts: dict[str, list[int]],
                          got: dict[str, list[int]], new_tokens: int) -> None:
    """Every sequence's tokens equal `generate`'s (which may stop early on EOS)."""
    for seq_id, prompt in prompts.items():
        expected = generate(reference, prompt, new_tokens)
        assert got[seq_id][:len(expected)] == expected, seq_id


def assert_rows_match(reference: torch.nn.Module, recorder: "RecordingSampler", atol: float) -> None:
    """Every recorded logits row equals a full forward over what its sequence had seen."""
    assert recorder.rows
    with torch.no_grad():
        for logits, seen in recorder.rows:
            torch.testing.assert_close(logits, reference(torch.tensor([seen])).logits[0, -1], atol=atol, rtol=0)


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [2] + [(7 * i + 13 * salt) % 370 + 10 for i in range(length - 1)]


class RecordingSampler:
    """Wraps the engine's sampler and keeps every logits row with what the sequence had seen."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.rows: list[tuple[torch.Tensor, list[int]]] = []

    def sample(self, logits: torch.Tensor, requests: list[SampleRequest]):
        for row, request in zip(logits, requests):
            self.rows.append((row.clone(), list(request.prompt_token_ids) + list(request.output_token_ids)))
        return self.inner.sample(logits, requests)

    def adjusted_token_ids(self, request: SampleRequest) -> set[int]:
        return self.inner.adjusted_token_ids(request)


@dataclass
class Driver:
    """Runs sequences to completion the way a scheduler would: one work item per
    unfinished sequence per step, checking pool invariants after every step."""
    engine: Engine
    outputs: dict[str, list[int]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    steps: list[StepOutput] = field(default_factory=list)

    def step(self, batch: StepBatch) -> StepOutput:
        out = self.engine.step(batch)
        self.engine.check_invariants()
        self.steps.append(out)
        for result in out.results:
            assert not result.error, result
            if result.num_cached_tokens:
                self.cached[result.seq_id] = result.num_cached_tokens
            if result.sampled:
                self.outputs.setdefault(result.seq_id, []).extend(result.token_ids)
        return out

    def run(self, prompts: dict[str, list[int]], max_new_tokens: int, chunk: dict[str, int] | None = None,
            sampling: dict[str, SamplingParams] | None = None, free_at_end: bool = True,
            draft_tokens: int = 0) -> dict[str, list[int]]:
        chunk = chunk or {}
        sampling = sampling or {}
        new = [NewSequence(seq_id, prompt, [], sampling.get(seq_id, SamplingParams()))
               for seq_id, prompt in prompts.items()]
        for seq_id in prompts:
            self.outputs[seq_id] = []
        while True:
            live = [seq_id for seq_id in prompts if len(self.outputs[seq_id]) < max_new_tokens]
            if not live:
                break
            self.step(StepBatch(new_sequences=new, work=[WorkItem(s, chunk.get(s, 1024), draft_tokens)
                                                         for s in live]))
            new = []
        if free_at_end:
            self.step(StepBatch(free_seq_ids=list(prompts)))
        return {seq_id: self.outputs[seq_id] for seq_id in prompts}


def recording_engine(kind: str, block_size: int = 4, **config) -> tuple[Engine, RecordingSampler]:
    engine = make_engine(kind, block_size=block_size, **config)
    recorder = RecordingSampler(engine.sampler)
    engine.sampler = recorder
    return engine, recorder


def first_step(driver: Driver, seq_id: str, prompt: list[int],
               sampling: SamplingParams | None = None) -> tuple[int, int, int]:
    """(cached tokens, computed tokens, batch tokens) of a new sequence's first step."""
    new = NewSequence(seq_id, prompt, [], sampling or SamplingParams())
    out = driver.step(StepBatch(new_sequences=[new], work=[WorkItem(seq_id, 1024)]))
    (result,) = out.results
    assert result.sampled
    return result.num_cached_tokens, result.num_computed_tokens, out.batch_tokens


def decode_and_free(driver: Driver, seq_id: str, new_tokens: int) -> list[int]:
    """Decodes `seq_id` one token per step up to `new_tokens` outputs, then frees it."""
    while len(driver.outputs[seq_id]) < new_tokens:
        driver.step(StepBatch(work=[WorkItem(seq_id, 1)]))
    driver.step(StepBatch(free_seq_ids=[seq_id]))
    return driver.outputs[seq_id]
