"""Prompt logprobs through the real stack (tiny model): /v1/completions with echo and
logprobs scores every prompt token as transformers does, over chunked prefills and
whether or not the prompt's blocks are cached; max_tokens 0 generates nothing. vLLM's
prompt_logprobs field gives the same numbers, ranked."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fairserve.launcher.stack import Stack

PROMPT = ("Once upon a time there was a small village by the sea where the fishermen told stories "
          "of a lighthouse that never went dark, and the children listened every night.")


def reference_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[position - 1, ids[position]]) for position in range(1, len(ids))]


def score(stack: Stack, **fields) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0, **fields}
    reply = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_echo_scores_the_prompt_as_transformers_does(tiny_stack: Stack, tiny_model_dir: Path) -> None:
    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(PROMPT)["input_ids"]
    assert len(ids) > 16    # more than one prefill chunk (PREFILL_CHUNK_SIZE)
    expected = reference_logprobs(tiny_model_dir, ids)
    for _ in range(2):      # the second time, the prompt's blocks are cached on the worker
        body = score(tiny_stack)
        choice = body["choices"][0]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-3)
        assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
        assert body["usage"] == {**body["usage"], "prompt_tokens": len(ids), "completion_tokens": 0}


def test_echo_with_generation_appends_the_completion(tiny_stack: Stack) -> None:
    body = score(tiny_stack, max_tokens=4, ignore_eos=True)
    choice = body["choices"][0]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    assert len(choice["logprobs"]["tokens"]) == body["usage"]["prompt_tokens"] + 4
    assert all(value is not None for value in choice["logprobs"]["token_logprobs"][1:])


def reference_rows(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_field_gives_echos_numbers_ranked(tiny_stack: Stack, tiny_model_dir: Path) -> None:
    """vLLM's prompt_logprobs: echo's numbers, the top k sorted with rank 1 the argmax, and
    each prompt token ranked in the whole vocabulary."""
    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(PROMPT)["input_ids"]
    rows = reference_rows(tiny_model_dir, ids)
    echo = score(tiny_stack, logprobs=5)["choices"][0]["logprobs"]
    reply = httpx.post(f"{tiny_stack.url}/v1/completions", timeout=120,
                       json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 5})
    assert reply.status_code == 200, reply.text
    scored = reply.json()["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for position in range(1, len(ids)):
        entry, own_key, row = scored[position], str(ids[position]), rows[position - 1]
        own = entry[own_key]
        assert own["logprob"] == pytest.approx(echo["token_logprobs"][position], abs=1e-5)
        top = sorted((value for key, value in entry.items() if key != own_key or len(entry) == 5),
                     key=lambda value: value["rank"])
        assert [value["rank"] for value in top] == [1, 2, 3, 4, 5]
        values = [value["logprob"] for value in top]
        assert values == sorted(values, reverse=True)
        # echo's top is keyed by text, where two tokens of the same text are one entry
        assert all(value == pytest.approx(min(values, key=lambda ours: abs(ours - value)), abs=1e-5)
                   for value in echo["top_logprobs"][position].values())
        assert values[0] == pytest.approx(float(row.max()), abs=1e-3)     # rank 1: the argmax
        target = row[ids[position]]
        assert int((row > target + 1e-3).sum()) < own["rank"] <= int((row >= target - 1e-3).sum())
