"""The internal token: its settings, the server interceptor (no token, wrong
token, right token; health open) on a real scheduler server, and the one
channel builder every internal client uses."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from fairserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.transport.grpc_server import check_health, insecure_channel, internal_channel
from common.transport.internal_auth import (
    TOKEN_METADATA_KEY, InternalAuth, TokenCheck, _denying, presents_token, token_interceptors,
)
from common.settings.env import SettingsError
from services.gateway.settings import GatewaySettings
from services.kvcache.settings import KvCacheSettings
from services.scheduler.server import SchedulerServer
from services.scheduler.settings import SchedulerSettings
from services.worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-internal-token-0123456789"
WRONG = "s3cret-internal-token-0123456788"    # same length, one character off


# ---- settings ----

def test_no_token_and_no_tls_by_default() -> None:
    auth = InternalAuth.from_env({})
    assert auth == InternalAuth() and not auth.token and not auth.tls
    assert token_interceptors(auth.token) == []


@pytest.mark.parametrize("read", [SchedulerSettings.from_env, WorkerSettings.from_env,
                                  KvCacheSettings.from_env, GatewaySettings.from_env])
def test_every_service_reads_the_token(read) -> None:
    worker_token = "s3cret-worker-token-0123456789ab"     # the scheduler and workers need it too
    settings = read({"INTERNAL_TOKEN": TOKEN, "WORKER_TOKEN": worker_token})
    assert settings.internal.token == TOKEN.encode()
    assert TOKEN not in repr(settings) and worker_token not in repr(settings)


def test_the_token_can_come_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert InternalAuth.from_env({"INTERNAL_TOKEN_FILE": str(path)}).token == TOKEN.encode()
    with pytest.raises(SettingsError, match="INTERNAL_TOKEN_FILE=.*cannot read"):
        InternalAuth.from_env({"INTERNAL_TOKEN_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SettingsError, match="INTERNAL_TOKEN_FILE=.*empty"):
        InternalAuth.from_env({"INTERNAL_TOKEN_FILE": str(tmp_path / "empty")})
    with pytest.raises(SettingsError, match="INTERNAL_TOKEN and INTERNAL_TOKEN_FILE"):
        InternalAuth.from_env({"INTERNAL_TOKEN": TOKEN, "INTERNAL_TOKEN_FILE": str(path)})


@pytest.mark.parametrize("token, problem", [("short-token", "at least 16"),
                                            ("has a space in the middle", "printable ASCII"),
                                            ("ünïcode-token-0123456789", "printable ASCII")])
def test_bad_tokens_are_refused_without_echoing_them(token: str, problem: str) -> None:
    with pytest.raises(SettingsError, match=f"INTERNAL_TOKEN is invalid.*{problem}") as error:
        InternalAuth.from_env({"INTERNAL_TOKEN": token})
    assert token not in str(error.value)


def test_the_token_never_shows_in_a_repr() -> None:
    auth = InternalAuth(token=TOKEN.encode(), cert=b"CERT", key=b"KEY", ca=b"CA")
    assert repr(auth) == "InternalAuth(token=set, tls=mutual)"
    assert TOKEN not in repr(SchedulerSettings(internal=auth)) and "KEY" not in repr(auth)


# ---- the server side, on a real scheduler ----

@pytest.fixture
async def scheduler() -> AsyncIterator[SchedulerServer]:
    server = SchedulerServer(SchedulerSettings(port=0, metrics_port=0, kvcache_addr="127.0.0.1:9",
                                               internal=InternalAuth(token=TOKEN.encode())))
    await server.start()
    yield server
    await server.stop(0)


def _calls(stub: scheduler_pb2_grpc.SchedulerStub, metadata: tuple = ()) -> dict[str, object]:
    """One call of every Scheduler method, as awaitables that end in the first reply or an error."""
    async def first_event() -> object:
        return await anext(aiter(stub.Generate(scheduler_pb2.GenerateRequest(
            request_id="r", prompt_token_ids=[1, 2, 3], max_tokens=2), timeout=5, metadata=metadata)))

    return {
        "Generate": first_event(),
        "Cancel": stub.Cancel(scheduler_pb2.CancelRequest(request_id="r"), timeout=5, metadata=metadata),
        "Stats": stub.Stats(common_pb2.StatsRequest(), timeout=5, metadata=metadata),
        "GetModelInfo": stub.GetModelInfo(scheduler_pb2.ModelInfoRequest(), timeout=5, metadata=metadata),
        "RegisterWorker": stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(
            worker_id="fake", address="127.0.0.1:9"), timeout=5, metadata=metadata),
        "Heartbeat": stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="fake"), timeout=5,
                                    metadata=metadata),
    }


async def _codes(address: str, metadata: tuple = (), auth: InternalAuth | None = None) -> dict[str, object]:
    codes: dict[str, object] = {}
    async with (internal_channel(address, auth) if auth else insecure_channel(address)) as channel:
        for name, call in _calls(scheduler_pb2_grpc.SchedulerStub(channel), metadata).items():
            try:
                await call
                codes[name] = "OK"
            except grpc.aio.AioRpcError as error:
                codes[name] = error.code()
                assert TOKEN not in (error.details() or "") and WRONG not in (error.details() or "")
    return codes


@pytest.mark.parametrize("metadata", [(), ((TOKEN_METADATA_KEY, WRONG),), ((TOKEN_METADATA_KEY, ""),),
                                      (("authorization", f"Bearer {TOKEN}"),),
                                      ((TOKEN_METADATA_KEY, TOKEN[:-1]),)],
                         ids=["none", "wrong", "empty", "other-header", "prefix"])
async def test_every_call_without_the_token_is_unauthenticated(scheduler, metadata, caplog) -> None:
    caplog.set_level(logging.WARNING)
    codes = await _codes(f"127.0.0.1:{scheduler.port}", metadata)
    assert codes == dict.fromkeys(codes, grpc.StatusCode.UNAUTHENTICATED)
    assert scheduler.service._links == {}      # the registration never got through
    assert "internal call refused" in caplog.text
    assert TOKEN not in caplog.text and WRONG not in caplog.text


async def test_the_right_token_reaches_the_service(scheduler) -> None:
    codes = await _codes(f"127.0.0.1:{scheduler.port}", auth=InternalAuth(token=TOKEN.encode()))
    assert codes == {"Generate": grpc.StatusCode.UNAVAILABLE,          # no worker yet
                     "Cancel": "OK", "Stats": "OK", "GetModelInfo": "OK",
                     "RegisterWorker": grpc.StatusCode.UNAVAILABLE,     # nothing listens on port 9
                     "Heartbeat": "OK"}
    metadata = ((TOKEN_METADATA_KEY, TOKEN), ("x-request-id", "abc"))   # the token by hand works too
    assert (await _codes(f"127.0.0.1:{scheduler.port}", metadata))["Stats"] == "OK"


async def test_health_stays_open_and_reflection_is_behind_the_token(scheduler) -> None:
    address = f"127.0.0.1:{scheduler.port}"
    async with insecure_channel(address) as channel:
        assert await check_health(channel)
        assert await check_health(channel, "fairserve.v1.Scheduler")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _list_services(channel)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    async with internal_channel(address, InternalAuth(token=TOKEN.encode())) as channel:
        assert "fairserve.v1.Scheduler" in await _list_services(channel)


async def _list_services(channel: grpc.aio.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                     timeout=5)
    reply = await anext(aiter(call))
    return [service.name for service in reply.list_services_response.service]


async def test_a_worker_with_the_token_registers_and_serves_one_without_does_not() -> None:
    """Scheduler -> worker and worker -> scheduler both carry the token."""
    from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
    from tests.unit.scheduler.fake_worker_server import FakeWorkerProcess

    auth = InternalAuth(token=TOKEN.encode())
    server = SchedulerServer(SchedulerSettings(port=0, metrics_port=0, kvcache_addr="127.0.0.1:9",
                                               internal=auth))
    await server.start()
    address = f"127.0.0.1:{server.port}"
    member = FakeWorkerProcess(FakeEngine(num_blocks=256), "w0", address, auth=auth)
    intruder = FakeWorkerProcess(FakeEngine(num_blocks=256), "w1", address,
                                 auth=InternalAuth(token=WRONG.encode()))
    try:
        await member.start()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await intruder.start()
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert list(server.service._links) == ["w0"]
        prompt = list(range(40, 52))
        async with internal_channel(address, auth) as channel:
            events = [event async for event in scheduler_pb2_grpc.SchedulerStub(channel).Generate(
                scheduler_pb2.GenerateRequest(request_id="r", prompt_token_ids=prompt, max_tokens=4),
                timeout=10)]
        assert [event.tokens[0].token_id for event in events] == reference_output(prompt, 4)
    finally:
        await intruder.stop()
        await member.stop()
        await server.stop(0)


# ---- pieces ----

def test_presents_token_compares_every_value_of_the_key() -> None:
    token = TOKEN.encode()
    assert presents_token(((TOKEN_METADATA_KEY, TOKEN),), token)
    assert presents_token(((TOKEN_METADATA_KEY, WRONG), (TOKEN_METADATA_KEY, TOKEN)), token)
    assert presents_token(((TOKEN_METADATA_KEY, token),), token)
    assert not presents_token(None, token)
    assert not presents_token((("x-other", TOKEN), (TOKEN_METADATA_KEY, TOKEN + "x")), token)


def test_the_denying_handler_keeps_the_shape_of_the_call() -> None:
    def serialize(message: bytes) -> bytes:
        return message

    for factory, shape in [(grpc.unary_unary_rpc_method_handler, "unary_unary"),
                           (grpc.unary_stream_rpc_method_handler, "unary_stream"),
                           (grpc.stream_unary_rpc_method_handler, "stream_unary"),
                           (grpc.stream_stream_rpc_method_handler, "stream_stream")]:
        denying = _denying(factory(lambda *_: None, request_deserializer=serialize,
                                   response_serializer=serialize))
        assert getattr(denying, shape) is not None
        assert denying.request_deserializer is serialize and denying.response_serializer is serialize
    with pytest.raises(ValueError):
        TokenCheck(b"")


def test_every_internal_channel_is_built_by_the_one_helper() -> None:
    """No service or script dials with grpc directly: the helper adds the token and TLS."""
    dialing = re.compile(r"\b(insecure_channel|secure_channel)\(")
    offenders = [f"{path.relative_to(ROOT)}:{number}"
                 for folder in ("services", "scripts", "common", "loadsim")
                 for path in sorted((ROOT / folder).rglob("*.py")) if path.name != "grpc_server.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if dialing.search(line)]
    assert offenders == []


def test_every_internal_server_is_built_with_the_settings_auth() -> None:
    """The scheduler, worker and kvcache servers take their settings' auth; only the
    gateway's public gRPC API (API keys, not the internal token) is built without."""
    sources = {name: (ROOT / path).read_text() for name, path in [
        ("scheduler", "services/scheduler/server.py"), ("worker", "services/worker/main.py"),
        ("kvcache", "services/kvcache/main.py")]}
    assert "settings.port, settings.internal,\n" in sources["scheduler"]
    assert "interceptors=worker_role_check(settings.worker_token))" in sources["scheduler"]
    assert "settings.port, settings.internal)" in sources["worker"]
    assert "build_server(service, settings.host, settings.port, settings.internal)" in sources["kvcache"]


def test_the_launcher_passes_the_settings_through_and_stops_on_a_bad_one(monkeypatch, capsys,
                                                                         tmp_path: Path) -> None:
    from fairserve.launcher import run_stack
    from fairserve.launcher.stack import Stack, StackPorts

    monkeypatch.setenv("INTERNAL_TOKEN", TOKEN)
    stack = Stack(ports=StackPorts(), env={}, log_dir=tmp_path)
    assert stack.service_env()["INTERNAL_TOKEN"] == TOKEN
    assert stack.internal_auth() == InternalAuth(token=TOKEN.encode())
    monkeypatch.setenv("INTERNAL_TOKEN", "too-short")
    monkeypatch.setenv("LOG_DIR", str(tmp_path))
    monkeypatch.setattr(Stack, "start", lambda *_: pytest.fail("started with a bad setting"))
    assert run_stack.main() == 2
    error = capsys.readouterr().err
    assert "INTERNAL_TOKEN is invalid" in error and "too-short" not in error
