"""The four services end to end over gRPC, as real processes, on a tiny model."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import shutil
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from fairserve.v1 import common_pb2, kvindex_pb2, scheduler_pb2, scheduler_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.observability import prometheus_names as names
from common.transport.grpc_server import check_health
from fairserve.launcher.stack import Stack
from tests.integration.helpers import stream_generate


def reference_greedy(model_dir: Path, prompt: str, max_new_tokens: int) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    generated = out[0, ids.shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    for index, token in enumerate(generated):
        if token in eos_ids:
            return generated[:index]
    return generated


def test_health_and_ready(tiny_stack: Stack) -> None:
    assert httpx.get(f"{tiny_stack.url}/health").status_code == 200
    ready = httpx.get(f"{tiny_stack.url}/ready")
    assert ready.status_code == 200, ready.text


def test_stream_events_shape(tiny_stack: Stack) -> None:
    events = stream_generate(tiny_stack.url, {"prompt": "The capital of France is", "max_tokens": 12,
                                              "raw": True, "ignore_eos": True})
    tokens, last = events[:-1], events[-1]
    assert all("token" in e and isinstance(e["token_id"], int) for e in tokens)
    assert last["finish_reason"] == "length"
    usage = last["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] > 0 and usage["cached_tokens"] >= 0


def test_greedy_matches_transformers(tiny_stack: Stack, tiny_model_dir: Path) -> None:
    prompt = "Once upon a time there was"
    expected = reference_greedy(tiny_model_dir, prompt, 16)
    events = stream_generate(tiny_stack.url, {"prompt": prompt, "max_tokens": 16, "raw": True})
    got = [e["token_id"] for e in events if "token_id" in e]
    assert got == expected


def test_non_stream_returns_text(tiny_stack: Stack) -> None:
    reply = httpx.post(f"{tiny_stack.url}/generate", json={"prompt": "Hello world", "max_tokens": 8,
                                                           "stream": False}, timeout=60)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert isinstance(body["text"], str) and body["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 8


def test_concurrent_requests_share_steps(tiny_stack: Stack) -> None:
    prompts = [f"Request number {i} says hello" for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: stream_generate(
            tiny_stack.url, {"prompt": p, "max_tokens": 10, "raw": True, "ignore_eos": True}), prompts))
    assert all(r[-1]["usage"]["completion_tokens"] == 10 for r in results)
    stats = httpx.get(f"{tiny_stack.url}/stats", timeout=10)
    assert stats.status_code == 200


async def _grpc_checks(stack: Stack) -> None:
    ports = stack.ports
    addresses = {"scheduler": ports.scheduler, "kvcache": ports.kvcache, "worker": ports.workers[0][0],
                 "gateway": ports.gateway_grpc}
    for name, port in addresses.items():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await check_health(channel), f"{name} health check failed"
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                list_services="")]))
            async for response in responses:
                names = {s.name for s in response.list_services_response.service}
                assert "grpc.health.v1.Health" in names, (name, names)
                assert any(n.startswith("fairserve.v1.") for n in names), (name, names)
                break

    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports.scheduler}") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        request = scheduler_pb2.GenerateRequest(
            request_id="grpc-direct", prompt_token_ids=[2, 10, 11, 12, 13], max_tokens=5,
            sampling=common_pb2.SamplingParams(temperature=0.0), ignore_eos=True, client_id="t")
        events = [event async for event in stub.Generate(request)]
        tokens = [t.token_id for e in events for t in e.tokens]
        assert len(tokens) == 5
        assert events[-1].finish.finish_reason == "length"
        stats = await stub.Stats(common_pb2.StatsRequest())
        assert any(w.healthy for w in stats.workers)


def test_grpc_health_reflection_and_direct_generate(tiny_stack: Stack) -> None:
    asyncio.run(_grpc_checks(tiny_stack))


def test_the_served_worker_runs_with_the_device_speed_ups(tiny_stack: Stack) -> None:
    """The worker builds its engine through its wiring (services/worker/wiring.py), the engine
    core importing no speed-up itself: on CPU its linears are packed, and where a C compiler
    builds the native kernels, both attention kernels are the native ones."""
    metrics = httpx.get(f"http://127.0.0.1:{tiny_stack.ports.workers[0][1]}/metrics", timeout=10).text
    info = re.search(names.WORKER_ENGINE_INFO.name + r"\{([^}]*)\}", metrics)
    assert info is not None, metrics
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
    if labels["device"] != "cpu":
        pytest.skip("the CPU speed-ups serve a CPU worker")
    assert labels["linear_kernel"] != "none"
    if shutil.which("cc"):
        assert (labels["prefill_attention"], labels["decode_attention"]) == ("native", "native")
