"""The worker role's token (common/transport/worker_auth.py): its settings, and on a real
scheduler the attack it stops: the gateway's INTERNAL_TOKEN alone cannot
register a worker (which would then receive every tenant's prompts), heartbeat
or drain one; a worker with WORKER_TOKEN registers and serves."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from fairserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

from common.transport.grpc_server import internal_channel
from common.transport.internal_auth import InternalAuth
from common.settings.env import SettingsError
from common.transport.worker_auth import WORKER_METHODS, worker_token_from_env, worker_token_interceptors
from services.gateway.settings import GatewaySettings
from services.kvcache.settings import KvCacheSettings
from services.scheduler.server import SchedulerServer
from services.scheduler.settings import SchedulerSettings
from services.worker.settings import WorkerSettings
from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.fake_worker_server import FakeWorkerProcess

ROOT = Path(__file__).resolve().parents[2]
INTERNAL = "s3cret-internal-token-0123456789"
WORKER = "s3cret-worker-token-abcdef012345"
SERVICES_AUTH = InternalAuth(token=INTERNAL.encode())


# ---- settings ----

def test_no_worker_token_without_an_internal_one() -> None:
    assert worker_token_from_env({}, b"") == b""
    assert worker_token_from_env({"WORKER_TOKEN": WORKER}, b"") == WORKER.encode()


@pytest.mark.parametrize("read", [SchedulerSettings.from_env, WorkerSettings.from_env])
def test_the_scheduler_and_workers_need_it_with_an_internal_token(read) -> None:
    with pytest.raises(SettingsError, match="WORKER_TOKEN is missing: with INTERNAL_TOKEN set") as missing:
        read({"INTERNAL_TOKEN": INTERNAL})
    assert INTERNAL not in str(missing.value)
    with pytest.raises(SettingsError, match="WORKER_TOKEN is invalid: it must differ from INTERNAL_TOKEN") as same:
        read({"INTERNAL_TOKEN": INTERNAL, "WORKER_TOKEN": INTERNAL})
    assert INTERNAL not in str(same.value)
    settings = read({"INTERNAL_TOKEN": INTERNAL, "WORKER_TOKEN": WORKER})
    assert settings.worker_token == WORKER.encode() and WORKER not in repr(settings)


def test_the_worker_token_is_checked_like_the_internal_one(tmp_path: Path) -> None:
    path = tmp_path / "worker_token"
    path.write_text(WORKER + "\n")
    assert worker_token_from_env({"WORKER_TOKEN_FILE": str(path)}, INTERNAL.encode()) == WORKER.encode()
    with pytest.raises(SettingsError, match="WORKER_TOKEN is invalid.*at least 16") as short:
        worker_token_from_env({"WORKER_TOKEN": "short-one"}, b"")
    assert "short-one" not in str(short.value)
    with pytest.raises(SettingsError, match="WORKER_TOKEN and WORKER_TOKEN_FILE are both set"):
        worker_token_from_env({"WORKER_TOKEN": WORKER, "WORKER_TOKEN_FILE": str(path)}, b"")


def test_the_gateway_and_kvcache_never_read_it() -> None:
    env = {"INTERNAL_TOKEN": INTERNAL, "WORKER_TOKEN": WORKER}
    for settings in (GatewaySettings.from_env(env), KvCacheSettings.from_env(env)):
        assert not hasattr(settings, "worker_token") and WORKER not in repr(settings)
    for folder in ("services/gateway", "services/kvcache"):
        for path in (ROOT / folder).rglob("*.py"):
            source = path.read_text()
            assert '"WORKER_TOKEN' not in source and "worker_auth" not in source, path


def test_the_guarded_methods_are_the_worker_rpcs_of_the_proto() -> None:
    assert WORKER_METHODS == {"/fairserve.v1.Scheduler/RegisterWorker", "/fairserve.v1.Scheduler/Heartbeat",
                              "/fairserve.v1.Scheduler/DrainWorker"}


# ---- on a real scheduler ----

@pytest.fixture
async def scheduler() -> AsyncIterator[SchedulerServer]:
    server = SchedulerServer(SchedulerSettings(port=0, metrics_port=0, kvcache_addr="127.0.0.1:9",
                                               internal=SERVICES_AUTH, worker_token=WORKER.encode()))
    await server.start()
    yield server
    await server.stop(0)


async def _worker_calls(address: str, auth: InternalAuth, worker_token: str = "") -> dict[str, object]:
    """The three worker RPCs, and Stats, with these credentials: status codes by method."""
    codes: dict[str, object] = {}
    async with internal_channel(address, auth, worker_token_interceptors(worker_token.encode())) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        calls = {
            "RegisterWorker": lambda: stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(
                worker_id="spy", address="127.0.0.1:9"), timeout=5),
            "Heartbeat": lambda: stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="w0"), timeout=5),
            "DrainWorker": lambda: stub.DrainWorker(scheduler_pb2.DrainWorkerRequest(worker_id="w0"), timeout=5),
            "Stats": lambda: stub.Stats(common_pb2.StatsRequest(), timeout=5),
        }
        for name, call in calls.items():
            try:
                await call()
                codes[name] = "OK"
            except grpc.aio.AioRpcError as error:
                codes[name] = error.code()
                assert INTERNAL not in (error.details() or "") and WORKER not in (error.details() or "")
    return codes


async def test_the_gateways_token_cannot_register_a_spy_worker(scheduler, caplog) -> None:
    """The attack: with INTERNAL_TOKEN only (what the gateway holds), a spy worker
    that answers Info registers and is sent prompts. Refused now."""
    caplog.set_level(logging.WARNING)
    address = f"127.0.0.1:{scheduler.port}"
    spy = FakeWorkerProcess(FakeEngine(num_blocks=64), "spy", address, auth=SERVICES_AUTH)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await spy.start()
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert refused.value.details() == "missing or invalid worker token"
    finally:
        await spy.stop()
    assert scheduler.service._links == {} and not scheduler.service._core.worker_ids()
    codes = await _worker_calls(address, SERVICES_AUTH)
    assert codes == {"RegisterWorker": grpc.StatusCode.PERMISSION_DENIED,
                     "Heartbeat": grpc.StatusCode.PERMISSION_DENIED,
                     "DrainWorker": grpc.StatusCode.PERMISSION_DENIED, "Stats": "OK"}
    assert await _worker_calls(address, SERVICES_AUTH, WORKER[::-1]) == codes      # a wrong one
    # Seven refusals from one host: one warning, with the caller's address and the reason.
    (record,) = [r for r in caplog.records if r.getMessage() == "internal call refused"]
    assert record.peer.startswith("ipv4:127.0.0.1:") and record.reason == "missing or invalid worker token"
    assert record.method == "/fairserve.v1.Scheduler/RegisterWorker" and record.suppressed == 0
    assert INTERNAL not in caplog.text and WORKER not in caplog.text
    assert all(INTERNAL not in str(vars(r)) and WORKER not in str(vars(r)) for r in caplog.records)


async def test_the_worker_token_alone_is_not_enough(scheduler) -> None:
    codes = await _worker_calls(f"127.0.0.1:{scheduler.port}", InternalAuth(), WORKER)
    assert codes == dict.fromkeys(codes, grpc.StatusCode.UNAUTHENTICATED)


async def test_a_worker_with_both_tokens_registers_and_serves(scheduler) -> None:
    address = f"127.0.0.1:{scheduler.port}"
    codes = await _worker_calls(address, SERVICES_AUTH, WORKER)
    assert codes == {"RegisterWorker": grpc.StatusCode.UNAVAILABLE,     # allowed; nothing listens on port 9
                     "Heartbeat": "OK", "DrainWorker": "OK", "Stats": "OK"}
    worker = FakeWorkerProcess(FakeEngine(num_blocks=256), "w0", address, auth=SERVICES_AUTH,
                               worker_token=WORKER.encode())
    try:
        await worker.start()
        assert list(scheduler.service._links) == ["w0"]
        prompt = list(range(40, 52))
        async with internal_channel(address, SERVICES_AUTH) as channel:    # the gateway's Generate
            events = [event async for event in scheduler_pb2_grpc.SchedulerStub(channel).Generate(
                scheduler_pb2.GenerateRequest(request_id="r", prompt_token_ids=prompt, max_tokens=4),
                timeout=10)]
        assert [event.tokens[0].token_id for event in events] == reference_output(prompt, 4)
    finally:
        await worker.stop()
