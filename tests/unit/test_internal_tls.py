"""TLS of the internal channels with a throwaway CA: the settings' checks, and
mutual TLS on a real scheduler server: a client without a certificate, with
one from another CA, or without TLS is refused; with a certificate the CA
signed (and the token) it is served."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from fairserve.v1 import common_pb2, scheduler_pb2_grpc

from common.transport.grpc_server import check_health, insecure_channel, internal_channel
from common.transport.internal_auth import InternalAuth
from common.settings.env import SettingsError
from services.scheduler.server import SchedulerServer
from services.scheduler.settings import SchedulerSettings

from tests.fixtures.tls import SERVER_NAME, Authority, Leaf, make_authority

TOKEN = "tls-test-internal-token-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Authority, Leaf, Leaf]:
    """The CA, a leaf it signed, and a leaf signed by an unrelated CA."""
    directory = tmp_path_factory.mktemp("pki")
    authority = make_authority(directory)
    return authority, authority.issue("node"), make_authority(directory, "other-ca").issue("stranger")


def _env(ca: Path | None = None, leaf: Leaf | None = None, server_name: str = SERVER_NAME) -> dict[str, str]:
    env = {"INTERNAL_TOKEN": TOKEN, "GRPC_TLS_SERVER_NAME": server_name}
    if ca is not None:
        env["GRPC_TLS_CA"] = str(ca)
    if leaf is not None:
        env.update(GRPC_TLS_CERT=str(leaf.cert), GRPC_TLS_KEY=str(leaf.key))
    return env


# ---- settings ----

def test_tls_settings_are_read_and_checked(pki, tmp_path: Path) -> None:
    authority, node, _ = pki
    auth = InternalAuth.from_env(_env(authority.cert, node))
    assert auth.tls and auth.mutual_tls and auth.server_name == SERVER_NAME
    assert auth.cert == node.cert.read_bytes() and auth.ca == authority.cert.read_bytes()
    assert "PRIVATE" not in repr(auth)
    client_only = InternalAuth.from_env(_env(authority.cert), serves=False)     # a gateway may verify only
    assert client_only.tls and not client_only.mutual_tls
    with pytest.raises(SettingsError, match="GRPC_TLS_CERT is missing: with GRPC_TLS_CA set, a server"):
        InternalAuth.from_env(_env(authority.cert))
    with pytest.raises(SettingsError, match="GRPC_TLS_KEY is missing"):
        InternalAuth.from_env({"GRPC_TLS_CERT": str(node.cert)})
    with pytest.raises(SettingsError, match="GRPC_TLS_CERT is missing"):
        InternalAuth.from_env({"GRPC_TLS_KEY": str(node.key)})
    with pytest.raises(SettingsError, match="GRPC_TLS_CA=.*cannot read"):
        InternalAuth.from_env({"GRPC_TLS_CA": str(tmp_path / "missing.pem")})
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(SettingsError, match="GRPC_TLS_CERT=.*not a PEM certificate"):
        InternalAuth.from_env({"GRPC_TLS_CERT": str(tmp_path / "junk.pem"), "GRPC_TLS_KEY": str(node.key)})
    with pytest.raises(SettingsError, match="GRPC_TLS_KEY=.*not a PEM private key"):
        InternalAuth.from_env({"GRPC_TLS_CERT": str(node.cert), "GRPC_TLS_KEY": str(node.cert)})
    with pytest.raises(SettingsError, match="GRPC_TLS_SERVER_NAME is set but TLS is off"):
        InternalAuth.from_env({"GRPC_TLS_SERVER_NAME": SERVER_NAME})


def test_every_service_reads_the_tls_settings(pki) -> None:
    authority, node, _ = pki
    settings = SchedulerSettings.from_env({**_env(authority.cert, node), "WORKER_TOKEN": "worker-" + TOKEN})
    assert settings.internal.mutual_tls and settings.internal.token == TOKEN.encode()


# ---- mutual TLS on a real server ----

@pytest.fixture
async def scheduler(pki) -> AsyncIterator[str]:
    authority, node, _ = pki
    server = SchedulerServer(SchedulerSettings(port=0, metrics_port=0, kvcache_addr="127.0.0.1:9",
                                               internal=InternalAuth.from_env(_env(authority.cert, node))))
    await server.start()
    yield f"127.0.0.1:{server.port}"
    await server.stop(0)


async def _stats(address: str, auth: InternalAuth | None) -> grpc.StatusCode:
    async with (internal_channel(address, auth) if auth else insecure_channel(address)) as channel:
        try:
            await scheduler_pb2_grpc.SchedulerStub(channel).Stats(common_pb2.StatsRequest(), timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def test_a_client_with_a_certificate_the_ca_signed_is_served(scheduler, pki) -> None:
    authority, node, _ = pki
    auth = InternalAuth.from_env(_env(authority.cert, node))
    assert await _stats(scheduler, auth) is grpc.StatusCode.OK
    async with internal_channel(scheduler, auth) as channel:
        assert await check_health(channel)


async def test_the_token_is_still_needed_over_mutual_tls(scheduler, pki) -> None:
    authority, node, _ = pki
    without_token = InternalAuth.from_env({k: v for k, v in _env(authority.cert, node).items()
                                           if k != "INTERNAL_TOKEN"})
    assert await _stats(scheduler, without_token) is grpc.StatusCode.UNAUTHENTICATED


async def test_clients_without_a_good_certificate_are_refused(scheduler, pki) -> None:
    authority, _, stranger = pki
    no_certificate = InternalAuth.from_env(_env(authority.cert), serves=False)
    assert await _stats(scheduler, no_certificate) is grpc.StatusCode.UNAVAILABLE
    other_ca = InternalAuth.from_env({**_env(authority.cert), "GRPC_TLS_CERT": str(stranger.cert),
                                      "GRPC_TLS_KEY": str(stranger.key)})
    assert await _stats(scheduler, other_ca) is grpc.StatusCode.UNAVAILABLE
    assert await _stats(scheduler, None) is grpc.StatusCode.UNAVAILABLE      # plaintext
    async with insecure_channel(scheduler) as channel:
        assert not await check_health(channel)


async def test_the_client_checks_the_server_name(scheduler, pki) -> None:
    authority, node, _ = pki
    wrong_name = InternalAuth.from_env(_env(authority.cert, node, server_name="someone.else"))
    assert await _stats(scheduler, wrong_name) is grpc.StatusCode.UNAVAILABLE
    no_override = InternalAuth.from_env({k: v for k, v in _env(authority.cert, node).items()
                                         if k != "GRPC_TLS_SERVER_NAME"})
    assert await _stats(scheduler, no_override) is grpc.StatusCode.UNAVAILABLE  # 127.0.0.1 is not in the cert
