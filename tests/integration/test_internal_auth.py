"""The real stack with an internal token, a worker token and mutual TLS (a CA
made here): a completion works end to end, every internal port (scheduler,
worker, kvcache) refuses calls without the token with UNAUTHENTICATED and
clients without a certificate, the health service stays open, the gateway's
public gRPC API needs no internal token, and the tokens show in no log, stats
or metrics. The worker RPCs need the worker token, which the gateway never
holds; a live worker's id cannot be re-bound, nor an address registered that
is not the caller's."""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from fairserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, kvindex_pb2, kvindex_pb2_grpc
from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

from common.transport.grpc_server import check_health, insecure_channel, internal_channel
from common.transport.internal_auth import InternalAuth
from common.transport.worker_auth import worker_token_interceptors
from fairserve.launcher.stack import Stack
from tests.fixtures.tls import SERVER_NAME, make_authority
from tests.integration.conftest import start_stack
from tests.integration.helpers import stream_generate
from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.fake_worker_server import FakeWorkerProcess

TOKEN = "integration-internal-token-7f3a9c1e5b"
WORKER_TOKEN = "integration-worker-token-c4d2e8a61f"

Call = Callable[[grpc.aio.Channel], Awaitable[object]]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    authority = make_authority(tmp_path_factory.mktemp("pki"))
    node = authority.issue("node")
    env = {"INTERNAL_TOKEN": TOKEN, "WORKER_TOKEN": WORKER_TOKEN,
           "GRPC_TLS_CA": str(authority.cert), "GRPC_TLS_CERT": str(node.cert),
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
            "DrainWorker": lambda c: scheduler(c).DrainWorker(scheduler_pb2.DrainWorkerRequest(
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
    assert len(codes) == 14 and codes == dict.fromkeys(codes, grpc.StatusCode.UNAUTHENTICATED)
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


async def test_the_tokens_show_in_no_log_stats_or_metrics(stack: Stack) -> None:
    await _codes(stack, dataclasses.replace(stack.internal_auth(), token=TOKEN[::-1].encode()))  # logged
    pages = [httpx.get(f"{stack.url}{path}", timeout=10).text for path in ("/stats", "/metrics")]
    for port in (stack.ports.scheduler_metrics, stack.ports.kvcache_metrics, stack.ports.workers[0][1]):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            pages.append(reply.read().decode())
    logs = [path.read_text(errors="replace") for path in stack.log_dir.glob("*.log")]
    assert len(logs) == 4 and "internal call refused" in "".join(logs)
    refusals = [json.loads(line) for line in (stack.log_dir / "scheduler.log").read_text().splitlines()
                if "internal call refused" in line]
    # Rate-limited per calling host (one line per 10 s), each with the caller's address: far
    # fewer lines than the 21 or more calls the scheduler refused in this module.
    assert refusals and all(entry["peer"].startswith("ipv4:127.0.0.1:") for entry in refusals)
    assert len(refusals) <= 6 and {"method", "reason", "suppressed"} <= set(refusals[0])
    for text in pages + logs:
        assert TOKEN not in text and TOKEN[::-1] not in text and WORKER_TOKEN not in text


# ---- credentials by role ----

def _environ(stack: Stack, name: str) -> bytes:
    return Path(f"/proc/{stack.processes[name].pid}/environ").read_bytes()


def test_only_the_scheduler_and_workers_hold_the_worker_token(stack: Stack) -> None:
    assert b"WORKER_TOKEN=" in _environ(stack, "scheduler") and b"WORKER_TOKEN=" in _environ(stack, "worker-0")
    for name in ("gateway", "kvcache"):
        assert b"WORKER_TOKEN" not in _environ(stack, name), name


async def test_the_gateways_token_cannot_register_a_spy_worker(stack: Stack) -> None:
    """The attack: a spy that answers Info like a worker registers with
    INTERNAL_TOKEN alone (all the gateway holds), and is sent prompts."""
    scheduler_addr = f"127.0.0.1:{stack.ports.scheduler}"
    spy = FakeWorkerProcess(FakeEngine(num_blocks=64), "spy", scheduler_addr, auth=stack.internal_auth())
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await spy.start()
    finally:
        await spy.stop()
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert _healthy_workers(stack) == ["worker-0"]
    port, calls = _internal_calls(stack)["scheduler"]
    async with internal_channel(f"127.0.0.1:{port}", stack.internal_auth()) as channel:
        for name in ("RegisterWorker", "Heartbeat", "DrainWorker", "Stats"):
            try:
                await calls[name](channel)
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as error:
                code = error.code()
            assert code is (grpc.StatusCode.OK if name == "Stats" else grpc.StatusCode.PERMISSION_DENIED), name
    assert _healthy_workers(stack) == ["worker-0"]


async def _register(stack: Stack, worker_id: str, address: str) -> tuple[grpc.StatusCode, str]:
    interceptors = worker_token_interceptors(stack.worker_token())
    async with internal_channel(f"127.0.0.1:{stack.ports.scheduler}", stack.internal_auth(), interceptors) as channel:
        try:
            await scheduler_pb2_grpc.SchedulerStub(channel).RegisterWorker(
                scheduler_pb2.RegisterWorkerRequest(worker_id=worker_id, address=address), timeout=30)
        except grpc.aio.AioRpcError as error:
            return error.code(), error.details()
    return grpc.StatusCode.OK, ""


async def test_a_live_worker_id_is_never_rebound_to_a_spy(stack: Stack) -> None:
    """With the worker token, a spy answering Info as worker-0 registers at its
    own address under worker-0's id: refused while worker-0 is live."""
    spy = FakeWorkerProcess(FakeEngine(num_blocks=64), "worker-0", f"127.0.0.1:{stack.ports.scheduler}",
                            auth=stack.internal_auth())
    await spy._server.start()
    try:
        code, message = await _register(stack, "worker-0", spy.address)
    finally:
        await spy.stop()
    assert code is grpc.StatusCode.ALREADY_EXISTS and "is live at another address" in message
    assert _healthy_workers(stack) == ["worker-0"]
    events = stream_generate(stack.url, {"prompt": "Hello", "max_tokens": 3, "raw": True, "ignore_eos": True})
    assert events[-1]["finish_reason"] == "length" and not spy.servicer.executed


async def test_an_address_that_is_not_the_callers_is_refused(stack: Stack) -> None:
    code, message = await _register(stack, "elsewhere", "192.0.2.1:50061")     # TEST-NET-1: not this host
    assert code is grpc.StatusCode.PERMISSION_DENIED
    assert "is not the caller's" in message and "this call comes from 127.0.0.1" in message
    assert _healthy_workers(stack) == ["worker-0"]


async def test_a_worker_with_the_worker_token_registers_and_drains(stack: Stack) -> None:
    scheduler_addr = f"127.0.0.1:{stack.ports.scheduler}"
    extra = FakeWorkerProcess(FakeEngine(num_blocks=64), "extra", scheduler_addr, auth=stack.internal_auth(),
                              worker_token=stack.worker_token())
    try:
        await extra.start()
        assert extra.epoch > 0 and sorted(_healthy_workers(stack)) == ["extra", "worker-0"]
        extra.stop_heartbeats()
        interceptors = worker_token_interceptors(stack.worker_token())
        async with internal_channel(scheduler_addr, stack.internal_auth(), interceptors) as channel:
            reply = await scheduler_pb2_grpc.SchedulerStub(channel).DrainWorker(
                scheduler_pb2.DrainWorkerRequest(worker_id="extra"), timeout=10)
        assert reply.known and reply.remaining == 0
        assert _healthy_workers(stack) == ["worker-0"]
    finally:
        await extra.stop()
