"""RegisterWorker checks what it is told: the worker id, the address to dial,
and the figures of the worker's Info; anything else is INVALID_ARGUMENT with a
message naming the field, and the worker never joins the rotation."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

from common.transport.grpc_server import GrpcServer, insecure_channel
from services.scheduler.workers.registration import (
    RegistrationError, WorkerFigures, check_address, check_worker_figures, check_worker_id,
)
from services.scheduler.server import SchedulerServer
from services.scheduler.settings import SchedulerSettings

GOOD = WorkerFigures(worker_id="w0", block_size=16, num_blocks=64, max_model_len=4096, vocab_size=1000)


@pytest.mark.parametrize("worker_id", ["w0", "worker-12", "gpu.node_3-a", "A" * 128])
def test_good_worker_ids(worker_id: str) -> None:
    check_worker_id(worker_id)


@pytest.mark.parametrize("worker_id, message", [
    ("", "worker_id is required"), ("a" * 129, "worker_id is too long"),
    ("-leading-dash", "worker_id '-leading-dash' is invalid"), ("has space", "invalid"),
    ("slash/es", "invalid"), ("new\nline", "invalid"), ("ünï", "invalid"), ("a:b", "invalid"),
])
def test_bad_worker_ids(worker_id: str, message: str) -> None:
    with pytest.raises(RegistrationError, match=message):
        check_worker_id(worker_id)


@pytest.mark.parametrize("address", ["127.0.0.1:50061", "worker-3:1", "node.example.com:65535",
                                     "[::1]:50061", "[fe80::1]:8080", "fairserve_worker_1:50061",
                                     "localhost.:443"])
def test_good_addresses(address: str) -> None:
    check_address(address)


@pytest.mark.parametrize("address, message", [
    ("", "is required"), ("127.0.0.1", "expected host:port"), (":50061", "expected host:port"),
    ("127.0.0.1:0", "port must be 1-65535"), ("127.0.0.1:65536", "port must be 1-65535"),
    ("127.0.0.1:-1", "port"), ("127.0.0.1:80a", "port"), ("host:", "port"),
    ("999.1.1.1:80", "not a host name"), ("::1:80", "not a host name"), ("[::g]:80", "not a host name"),
    ("unix:/tmp/socket", "port"), ("dns:///evil:80", "not a host name"),
    ("http://host:80", "not a host name"), ("a b:80", "not a host name"),
    ("-bad.example:80", "not a host name"), ("a..b:80", "not a host name"),
    (("a" * 64) + ".example:80", "not a host name"),
])
def test_bad_addresses(address: str, message: str) -> None:
    with pytest.raises(RegistrationError, match=f"address.*{message}"):
        check_address(address)


@pytest.mark.parametrize("field", ["block_size", "num_blocks", "max_model_len", "vocab_size"])
@pytest.mark.parametrize("value", [0, -4])
def test_worker_figures_must_be_positive(field: str, value: int) -> None:
    check_worker_figures(GOOD, "w0")
    bad = WorkerFigures(**{**GOOD.__dict__, field: value})
    with pytest.raises(RegistrationError, match=f"worker info {field} must be positive, got {value}"):
        check_worker_figures(bad, "w0")


def test_the_info_must_name_the_registered_worker() -> None:
    check_worker_figures(WorkerFigures(**{**GOOD.__dict__, "worker_id": ""}), "w0")   # says nothing
    with pytest.raises(RegistrationError, match="worker_id 'w9' does not match.*'w0'"):
        check_worker_figures(GOOD, "w9")


# ---- through gRPC ----

class InfoOnly(worker_pb2_grpc.WorkerServicer):
    def __init__(self, info: worker_pb2.WorkerInfo) -> None:
        self.info = info

    async def Info(self, request: worker_pb2.InfoRequest,
                   context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return self.info


@pytest.fixture
async def scheduler() -> AsyncIterator[tuple[SchedulerServer, scheduler_pb2_grpc.SchedulerStub]]:
    server = SchedulerServer(SchedulerSettings(port=0, metrics_port=0, kvcache_addr="127.0.0.1:9"))
    await server.start()
    channel = insecure_channel(f"127.0.0.1:{server.port}")
    yield server, scheduler_pb2_grpc.SchedulerStub(channel)
    await channel.close()
    await server.stop(0)


async def _register(stub: scheduler_pb2_grpc.SchedulerStub, worker_id: str,
                    address: str) -> tuple[grpc.StatusCode, str]:
    try:
        await stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker_id=worker_id, address=address),
                                  timeout=5)
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


async def test_register_worker_refuses_bad_ids_and_addresses(scheduler) -> None:
    server, stub = scheduler
    refused = (grpc.StatusCode.INVALID_ARGUMENT, "worker_id is required")
    assert await _register(stub, "", "127.0.0.1:1") == refused
    code, message = await _register(stub, "w0", "127.0.0.1:99999")
    assert code is grpc.StatusCode.INVALID_ARGUMENT and message.startswith("address '127.0.0.1:99999'")
    code, message = await _register(stub, "x" * 500, "127.0.0.1:1")
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "worker_id is too long" in message
    assert server.service._links == {}


@pytest.mark.parametrize("field", ["block_size", "num_blocks", "max_model_len", "vocab_size"])
async def test_register_worker_refuses_a_worker_whose_info_is_not_sane(scheduler, field: str) -> None:
    server, stub = scheduler
    info = worker_pb2.WorkerInfo(worker_id="w0", block_size=4, num_blocks=64, max_model_len=256,
                                 vocab_size=1000, eos_token_ids=[1])
    setattr(info, field, 0)
    worker = GrpcServer([(worker_pb2_grpc.add_WorkerServicer_to_server, InfoOnly(info))],
                        ["fairserve.v1.Worker"], "127.0.0.1", 0)
    await worker.start()
    try:
        code, message = await _register(stub, "w0", f"127.0.0.1:{worker.port}")
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert message == f"worker info {field} must be positive, got 0"
        assert server.service._links == {} and not server.service._core.worker_ids()
        setattr(info, field, 8)      # the same worker, sane now, is taken
        assert await _register(stub, "w0", f"127.0.0.1:{worker.port}") == (grpc.StatusCode.OK, "")
        assert list(server.service._links) == ["w0"]
    finally:
        await worker.stop(0)
