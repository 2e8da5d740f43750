"""LoRA adapters through the real processes (tiny model): an r=8 adapter on q_proj/v_proj served
beside the base model gives its merged model's prompt logprobs (within 1e-3) and greedy text;
base and adapter requests mixed 8 at a time each equal their solo outputs; the adapter reads
none of the prompt the base just read; a runtime load is served and an unload is then a 404."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from fairserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

from fairserve.launcher.stack import Stack
from tests.fixtures.tiny_lora import save_random_adapter
from tests.integration.conftest import start_stack

LOGPROB_ATOL = 1e-3
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def lora_root(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """LORA_ROOT with `qv` (r=8 on q_proj/v_proj) and `late` (loaded at runtime), and their merged models."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("lora-root")
    merged = {name: save_random_adapter(root / name, base.config, seed=seed, base=base)
              for seed, name in enumerate(("qv", "late"), start=1)}
    return root, {"": base, **merged}


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, lora_root: tuple[Path, dict],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root, _ = lora_root
    stack = start_stack(tmp_path_factory.mktemp("lora-stack"), tiny_model_dir, extra_env={
        "LORA_MODULES": f"qv={root / 'qv'}", "LORA_ROOT": str(root), "LORA_RUNTIME_UPDATES": "true",
        "MAX_LORAS": "2"})
    yield stack
    stack.stop()


def complete(url: str, model: str | None, prompt: list[int], **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, **extra}
    if model is not None:
        body["model"] = model
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def reference(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             min_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist(), [float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))]


def prompt_ids(seed: int, length: int = 14) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(10, 370) for _ in range(length - 1)]


def test_the_adapter_equals_its_merged_model(stack: Stack, lora_root) -> None:
    _, models = lora_root
    models_listed = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"]
    assert [card["id"] for card in models_listed][1:] == ["qv"] and models_listed[1]["parent"]
    prompt = prompt_ids(1)
    for name in ("qv", ""):
        body = complete(stack.url, name or None, prompt, prompt_logprobs=0, logprobs=0)
        choice = body["choices"][0]
        expected_tokens, expected_logprobs = reference(models[name], prompt)
        got = [entry[str(token)]["logprob"] for entry, token in zip(choice["prompt_logprobs"][1:], prompt[1:])]
        assert max(abs(a - b) for a, b in zip(got, expected_logprobs)) < LOGPROB_ATOL, name
        assert greedy_ids(stack, prompt, name) == expected_tokens, name
    assert reference(models["qv"], prompt)[1] != reference(models[""], prompt)[1]


def greedy_ids(stack: Stack, prompt: list[int], adapter: str) -> list[int]:
    """The greedy token ids of one request sent to the scheduler (its token ids, not text)."""
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports.scheduler}") as channel:
        request = scheduler_pb2.GenerateRequest(
            request_id=f"lora-{adapter}-{prompt[1]}", prompt_token_ids=prompt, max_tokens=NEW_TOKENS,
            ignore_eos=True, sampling=common_pb2.SamplingParams(temperature=0.0), lora_name=adapter)
        events = list(scheduler_pb2_grpc.SchedulerStub(channel).Generate(request, timeout=60))
    return [token.token_id for event in events for token in event.tokens]


def test_mixed_requests_equal_their_solo_outputs(stack: Stack) -> None:
    requests = [("qv" if i % 2 else None, prompt_ids(100 + i, 10 + i)) for i in range(8)]
    solo = [complete(stack.url, model, prompt)["choices"][0]["text"] for model, prompt in requests]
    with ThreadPoolExecutor(8) as pool:
        mixed = list(pool.map(lambda r: complete(stack.url, *r)["choices"][0]["text"], requests))
    assert mixed == solo


def test_the_adapter_reads_none_of_the_prompt_the_base_just_read(stack: Stack) -> None:
    prompt = prompt_ids(7, 4 * 4 + 3)
    complete(stack.url, None, prompt)
    again = complete(stack.url, None, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
    adapter = complete(stack.url, "qv", prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again > 0 and adapter == 0


def test_runtime_load_is_served_and_unload_is_then_a_404(stack: Stack, lora_root) -> None:
    _, models = lora_root
    url = stack.url
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "late"}, timeout=30)
    assert loaded.status_code == 200, loaded.text
    prompt = prompt_ids(11)
    expected_tokens, expected_logprobs = reference(models["late"], prompt)
    choice = complete(url, "late", prompt, prompt_logprobs=0)["choices"][0]
    got = [entry[str(token)]["logprob"] for entry, token in zip(choice["prompt_logprobs"][1:], prompt[1:])]
    assert max(abs(a - b) for a, b in zip(got, expected_logprobs)) < LOGPROB_ATOL
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=30)
    assert unloaded.status_code == 200
    gone = httpx.post(f"{url}/v1/completions", json={"model": "late", "prompt": prompt, "max_tokens": 2}, timeout=30)
    assert gone.status_code == 404
