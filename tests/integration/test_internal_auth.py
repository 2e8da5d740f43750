"""The real stack with an internal token and mutual TLS (a CA made here): a
completion works end to end, every internal port (scheduler, worker, kvcache)
refuses calls without the token with UNAUTHENTICATED and clients without a
certificate, the health service stays open, the gateway's public gRPC API
needs no internal token, and the token shows in no log, stats or metrics."""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from fairserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, kvindex_pb2, kvindex_pb2_grpc
from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

from common.grpc_server import check_health, insecure_channel, internal_channel
from common.internal_auth import InternalAuth
from scripts.stack import Stack
from tests.fixtures.tls import SERVER_NAME, make_authority
from tests.integration.conftest import start_stack
from tests.integration.helpers import stream_generate

TOKEN = "integration-internal-token-7f3a9c1e5b"

Call = Callable[[grpc.aio.Channel], Awaitable[object]]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    authority = make_authority(tmp_path_factory.mktemp("pki"))
    node = authority.issue("node")
    env = {"INTERNAL_TOKEN": TOKEN, "GRPC_TLS_CA": str(authority.cert), "GRPC_TLS_CERT": str(node.cert),
           "GRPC_TLS_KEY": str(node.key), "GRPC_TLS_SERVER_NAME": SERVER_NAME}
    stack = start_stack(tmp_path_factory.mktemp("secure-stack"), tiny_model_dir, extra_env=env)
    yield stack
    stack.stop()


def _internal_calls(stack: Stack) -> dict[str, tuple[int, dict[str, Call]]]:
    """Every method of every internal port, as a call on a channel."""
    worker_port = stack.ports.workers[0][0]

    def scheduler(channel: grpc.aio.Channel) -> scheduler_pb2_grpc.SchedulerStub:
        return scheduler_pb2_grpc.SchedulerStub(channel)

    async def generate(channel: grpc.aio.Channel) -> object:
        return await anext(aiter(scheduler(channel).Generate(scheduler_pb2.GenerateRequest(
            request_id="intruder", prompt_token_ids=[5, 6, 7], max_tokens=2), timeout=10)))

    async def step_stream(channel: grpc.aio.Channel) -> object:
        # Refused at the call's start, before any request: a request written while the refusal
        # is under way can end the call as INTERNAL instead, so the read alone says how.
        return await worker_pb2_grpc.WorkerStub(channel).StepStream(timeout=10).read()

    return {
        "scheduler": (stack.ports.scheduler, {
            "Generate": generate,
            "Cancel": lambda c: scheduler(c).Cancel(scheduler_pb2.CancelRequest(request_id="x"), timeout=10),
            "Stats": lambda c: scheduler(c).Stats(common_pb2.StatsRequest(), timeout=10),
            "GetModelInfo": lambda c: scheduler(c).GetModelInfo(scheduler_pb2.ModelInfoRequest(), timeout=10),
            # the real worker's address under another name: a fake worker would get its prompts
            "RegisterWorker": lambda c: scheduler(c).RegisterWorker(scheduler_pb2.RegisterWorkerRequest(
                worker_id="intruder", address=f"127.0.0.1:{worker_port}"), timeout=10),
            "Heartbeat": lambda c: scheduler(c).Heartbeat(scheduler_pb2.HeartbeatRequest(
                worker_id="worker-0"), timeout=10),
        }),
        "worker": (worker_port, {
            "Step": lambda c: worker_pb2_grpc.WorkerStub(c).Step(worker_pb2.StepRequest(), timeout=10),
            "StepStream": step_stream,
            "Info": lambda c: worker_pb2_grpc.WorkerStub(c).Info(worker_pb2.InfoRequest(), timeout=10),
            "Stats": lambda c: worker_pb2_grpc.WorkerStub(c).Stats(common_pb2.StatsRequest(), timeout=10),
        }),
        "kvcache": (stack.ports.kvcache, {
            "Lookup": lambda c: kvindex_pb2_grpc.KvIndexStub(c).Lookup(
                kvindex_pb2.LookupRequest(token_ids=[1, 2, 3, 4, 5]), timeout=10),
            "Publish": lambda c: kvindex_pb2_grpc.KvIndexStub(c).Publish(
                kvindex_pb2.PublishRequest(worker_id="intruder"), timeout=10),
            "Stats": lambda c: kvindex_pb2_grpc.KvIndexStub(c).Stats(common_pb2.StatsRequest(), timeout=10),
        }),
    }


async def _codes(stack: Stack, auth: InternalAuth | None) -> dict[str, grpc.StatusCode]:
    codes = {}
    for service, (port, calls) in _internal_calls(stack).items():
        address = f"127.0.0.1:{port}"
        async with (internal_channel(address, auth) if auth else insecure_channel(address)) as channel:
            for name, call in calls.items():
                try:
                    await call(channel)
                    codes[f"{service}.{name}"] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as error:
                    codes[f"{service}.{name}"] = error.code()
                    assert TOKEN not in (error.details() or "")
    return codes


def _healthy_workers(stack: Stack) -> list[str]:
    stats = httpx.get(f"{stack.url}/stats", timeout=10).json()
    return [worker["worker_id"] for worker in stats["scheduler"]["workers"] if worker["healthy"]]


def test_a_completion_works_end_to_end(stack: Stack) -> None:
    events = stream_generate(stack.url, {"prompt": "The capital of France is", "max_tokens": 6,
                                         "raw": True, "ignore_eos": True})
    assert events and events[-1]["finish_reason"] == "length"
    assert _healthy_workers(stack) == ["worker-0"]
    kvcache = httpx.get(f"{stack.url}/stats", timeout=10).json()["kvcache"]
    assert kvcache is not None      # the gateway reaches the index with the token too


async def test_every_internal_port_refuses_calls_without_the_token(stack: Stack) -> None:
    auth = stack.internal_auth()
    assert auth.mutual_tls and auth.token == TOKEN.encode()
    codes = await _codes(stack, dataclasses.replace(auth, token=b""))
    assert len(codes) == 13 and codes == dict.fromkeys(codes, grpc.StatusCode.UNAUTHENTICATED)
    wrong = await _codes(stack, dataclasses.replace(auth, token=TOKEN[::-1].encode()))
    assert wrong == codes
    assert _healthy_workers(stack) == ["worker-0"]      # the intruder never registered
    async with internal_channel(f"127.0.0.1:{stack.ports.workers[0][0]}", auth) as channel:
        info = await worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)
    assert info.worker_id == "worker-0"


async def test_clients_without_a_certificate_are_refused_everywhere(stack: Stack) -> None:
    auth = stack.internal_auth()
    no_certificate = dataclasses.replace(auth, cert=None, key=None)
    for client in (no_certificate, None):       # TLS without a client certificate; plaintext
        codes = await _codes(stack, client)
        assert codes == dict.fromkeys(codes, grpc.StatusCode.UNAVAILABLE)


async def test_health_stays_open_without_the_token(stack: Stack) -> None:
    probe = dataclasses.replace(stack.internal_auth(), token=b"")
    for port in (stack.ports.scheduler, stack.ports.workers[0][0], stack.ports.kvcache):
        async with internal_channel(f"127.0.0.1:{port}", probe) as channel:
            assert await check_health(channel, timeout_s=5)


async def test_the_public_grpc_api_needs_no_internal_token(stack: Stack) -> None:
    async with insecure_channel(f"127.0.0.1:{stack.ports.gateway_grpc}") as channel:
        reply = await gateway_pb2_grpc.TextGenerationStub(channel).Generate(
            gateway_pb2.TextRequest(prompt="Hello", max_tokens=3, raw=True, ignore_eos=True), timeout=60)
    assert reply.finish_reason == "length"


async def test_the_token_shows_in_no_log_stats_or_metrics(stack: Stack) -> None:
    await _codes(stack, dataclasses.replace(stack.internal_auth(), token=TOKEN[::-1].encode()))  # logged
    pages = [httpx.get(f"{stack.url}{path}", timeout=10).text for path in ("/stats", "/metrics")]
    for port in (stack.ports.scheduler_metrics, stack.ports.kvcache_metrics, stack.ports.workers[0][1]):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            pages.append(reply.read().decode())
    logs = [path.read_text(errors="replace") for path in stack.log_dir.glob("*.log")]
    assert len(logs) == 4 and "internal call refused" in "".join(logs)
    for text in pages + logs:
        assert TOKEN not in text and TOKEN[::-1] not in text
