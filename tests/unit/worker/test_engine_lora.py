"""LoRA adapters in the engine: an adapter's prompt logprobs within 1e-3 of the same adapter
merged into the weights (transformers + peft), the same greedy tokens, alone and in mixed
batches (the base and several adapters in one step), and an adapter's KV never shared with the
base model's or another adapter's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from common.types import SamplingParams
from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.lora import layers
from services.worker.engine.lora.registry import LoraConfig
from services.worker.wiring import build_engine
from tests.fixtures.tiny_lora import save_random_adapter
from tests.fixtures.tiny_model import build_model
from tests.unit.worker.engine_helpers import CONFIGS, generate, prompt_of

LOGPROB_ATOL = 1e-3
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(kind: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """name -> (directory, merged model): r=8 on q/v, and rsLoRA r=4 on every projection."""
    root = tmp_path_factory.mktemp(f"loras-{kind}")
    config = CONFIGS[kind]()
    qv = save_random_adapter(root / "qv", config, seed=1)
    every = save_random_adapter(root / "all", config, seed=2, r=4, use_rslora=True,
                                target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"))
    return {"qv": (root / "qv", qv), "all": (root / "all", every)}


def _engine(kind: str, adapters: dict, **config) -> Engine:
    model = build_model(copy.deepcopy(CONFIGS[kind]()))
    lora = LoraConfig(modules={name: str(path) for name, (path, _) in adapters.items()}, max_loras=4, max_rank=16)
    return build_engine(EngineConfig(model_dir="", num_blocks=256, block_size=4, model_key=kind, lora=lora, **config),
                        model=model)


def _run(engine: Engine, requests: dict[str, tuple[list[int], str]], new_tokens: int = NEW_TOKENS,
         params: SamplingParams = SamplingParams(), chunk: int = 1024) -> tuple[dict, dict, dict]:
    """Runs every request (seq_id -> (prompt, adapter)) together to `new_tokens`; returns the
    tokens, the prompt logprobs (position -> logprob) and the cached tokens of each."""
    new = [NewSequence(seq_id, tuple(prompt), (), params, lora_name=adapter)
           for seq_id, (prompt, adapter) in requests.items()]
    tokens = {seq_id: [] for seq_id in requests}
    scored = {seq_id: {} for seq_id in requests}
    cached = {seq_id: 0 for seq_id in requests}
    while live := [s for s in requests if len(tokens[s]) < new_tokens]:
        out = engine.step(StepBatch(new_sequences=new, work=[WorkItem(s, chunk) for s in live]))
        new = []
        for result in out.results:
            assert not result.error, result
            cached[result.seq_id] += result.num_cached_tokens
            for offset, logprob in enumerate(result.prompt_logprobs):
                scored[result.seq_id][result.prompt_logprobs_start + offset] = logprob.logprob
            tokens[result.seq_id].extend(result.token_ids)
    engine.step(StepBatch(free_seq_ids=list(requests)))
    return tokens, scored, cached


def _reference(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return generate(model, prompt, NEW_TOKENS), [float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))]


def _check(requests, tokens, scored, models) -> None:
    for seq_id, (prompt, adapter) in requests.items():
        expected_tokens, expected_logprobs = _reference(models[adapter], prompt)
        assert tokens[seq_id][:len(expected_tokens)] == expected_tokens, seq_id
        got = [scored[seq_id][position] for position in range(1, len(prompt))]
        assert max(abs(a - b) for a, b in zip(got, expected_logprobs)) < LOGPROB_ATOL, seq_id


def test_an_adapter_alone_equals_its_merged_model(kind: str, reference: torch.nn.Module, adapters) -> None:
    engine = _engine(kind, adapters)
    models = {"": reference, **{name: merged for name, (_, merged) in adapters.items()}}
    params = SamplingParams(prompt_logprobs=True, logprobs=True)
    for adapter in ("qv", "all"):
        requests = {f"solo-{adapter}": (prompt_of(13, 1), adapter)}
        tokens, scored, _ = _run(engine, requests, params=params)
        _check(requests, tokens, scored, models)
    # The adapters change the outputs: the base model's differ from theirs.
    assert _reference(reference, prompt_of(13, 1))[1] != _reference(adapters["qv"][1], prompt_of(13, 1))[1]


@pytest.mark.parametrize("stacked_rows", [256, 0], ids=["stacked", "grouped"])
def test_mixed_batches_equal_their_solo_outputs(kind: str, reference: torch.nn.Module, adapters,
                                                stacked_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Base and adapter sequences 8 at a time, prefills chunked so decodes and chunks mix; through
    the stacked update (lora/stacked.py) and the grouped one."""
    monkeypatch.setattr(layers, "STACKED_MAX_ROWS", stacked_rows)
    engine = _engine(kind, adapters)
    models = {"": reference, **{name: merged for name, (_, merged) in adapters.items()}}
    names = ["", "qv", "all", "qv", "", "all", "qv", ""]
    requests = {f"m{i}": (prompt_of(9 + i, i), name) for i, name in enumerate(names)}
    params = SamplingParams(prompt_logprobs=True, logprobs=True)
    tokens, scored, _ = _run(engine, requests, params=params, chunk=5)
    _check(requests, tokens, scored, models)
    solo_tokens = {}
    for seq_id, request in requests.items():
        solo_tokens.update(_run(engine, {f"solo-{seq_id}": request}, params=params)[0])
    assert all(tokens[s] == solo_tokens[f"solo-{s}"] for s in requests)


def test_an_adapter_gets_none_of_the_base_models_cached_blocks(kind: str, adapters) -> None:
    engine = _engine(kind, adapters)
    prompt = prompt_of(21, 5)
    _run(engine, {"base": (prompt, "")})
    assert _run(engine, {"base-again": (prompt, "")})[2]["base-again"] > 0      # the base reuses its own
    assert _run(engine, {"adapter": (prompt, "qv")})[2]["adapter"] == 0
    assert _run(engine, {"other": (prompt, "all")})[2]["other"] == 0
    assert _run(engine, {"adapter-again": (prompt, "qv")})[2]["adapter-again"] > 0


def test_an_unknown_adapter_fails_its_sequence_alone(kind: str, adapters) -> None:
    engine = _engine(kind, adapters)
    new = [NewSequence("bad", tuple(prompt_of(7)), (), SamplingParams(), lora_name="nope", lora_path="/etc"),
           NewSequence("good", tuple(prompt_of(7)), (), SamplingParams(), lora_name="qv")]
    out = engine.step(StepBatch(new_sequences=new, work=[WorkItem("bad", 64), WorkItem("good", 64)]))
    errors = {result.seq_id: result.error for result in out.results}
    assert errors["bad"] and not errors["good"]


def test_the_plain_paths_serve_adapters_too(kind: str, reference: torch.nn.Module, adapters) -> None:
    """transformers' forward over plain linears (no direct forward, no packs, no C kernels)."""
    engine = _engine(kind, adapters, direct_forward="off", cpu_packed_weights=False, cpu_native_kernels="off")
    assert engine.direct_forward == "transformers"
    models = {"": reference, **{name: merged for name, (_, merged) in adapters.items()}}
    requests = {f"p{i}": (prompt_of(8 + i, i), name) for i, name in enumerate(["", "qv", "all", "qv"])}
    tokens, scored, _ = _run(engine, requests, params=SamplingParams(prompt_logprobs=True, logprobs=True), chunk=5)
    _check(requests, tokens, scored, models)
