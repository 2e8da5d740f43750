"""Authentication between the services: the shared internal token and the
optional TLS of the internal gRPC channels (scheduler, workers, kvcache).

`InternalAuth.from_env` reads and checks the settings once at start. A server
built with it (`common.transport.grpc_server.GrpcServer`) refuses calls without the token
with UNAUTHENTICATED, except the standard health service; every internal
channel (`common.transport.grpc_server.internal_channel`) sends the token. The same check,
under another metadata key and for some methods only, guards a role's token
(common/transport/worker_auth.py). The tokens and the key material never appear in a
repr, a log line or an error message.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from common.transport.refusal_log import RefusalLog
from common.settings.env import EnvReader, SettingsError

TOKEN_METADATA_KEY = "x-fairserve-internal-token"
MIN_TOKEN_LENGTH = 16
# Probes cannot send metadata, and the health service reveals nothing.
OPEN_SERVICES = ("grpc.health.v1.Health",)
DENIED_MESSAGE = "missing or invalid internal token"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InternalAuth:
    """The token every internal call carries (empty: none is required), and the
    PEM material of the internal channels' TLS (None: plaintext)."""

    token: bytes = field(default=b"", repr=False)
    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)
    ca: bytes | None = field(default=None, repr=False)
    server_name: str = ""

    @property
    def tls(self) -> bool:
        return self.cert is not None or self.ca is not None

    @property
    def mutual_tls(self) -> bool:
        """A server with a CA requires client certificates signed by it."""
        return self.cert is not None and self.ca is not None

    def __repr__(self) -> str:
        tls = "mutual" if self.mutual_tls else "on" if self.tls else "off"
        return f"InternalAuth(token={'set' if self.token else 'none'}, tls={tls})"

    @classmethod
    def from_env(cls, env: Mapping[str, str], serves: bool = True) -> InternalAuth:
        """`serves`: the process runs an internal server (it needs its own
        certificate when a CA is given, to require client certificates)."""
        read = EnvReader(env)
        cert = _read_pem(read, "GRPC_TLS_CERT", "CERTIFICATE")
        key = _read_pem(read, "GRPC_TLS_KEY", "PRIVATE KEY")
        ca = _read_pem(read, "GRPC_TLS_CA", "CERTIFICATE")
        if (cert is None) != (key is None):
            missing = "GRPC_TLS_KEY" if key is None else "GRPC_TLS_CERT"
            raise SettingsError(f"{missing} is missing: GRPC_TLS_CERT and GRPC_TLS_KEY go together")
        if serves and ca is not None and cert is None:
            raise SettingsError("GRPC_TLS_CERT is missing: with GRPC_TLS_CA set, a server needs its own "
                                "certificate and key (GRPC_TLS_CERT, GRPC_TLS_KEY) for mutual TLS")
        server_name = read.str("GRPC_TLS_SERVER_NAME", "")
        if server_name and cert is None and ca is None:
            raise SettingsError("GRPC_TLS_SERVER_NAME is set but TLS is off: set GRPC_TLS_CA "
                                "or GRPC_TLS_CERT and GRPC_TLS_KEY")
        return cls(token=_read_token(read), cert=cert, key=key, ca=ca, server_name=server_name)


def _read_token(read: EnvReader) -> bytes:
    return read_token(read, "INTERNAL_TOKEN", "INTERNAL_TOKEN_FILE")


def read_token(read: EnvReader, name: str, file_name: str) -> bytes:
    """A token from `name` or the file named by `file_name` (empty: none); at
    least MIN_TOKEN_LENGTH printable ASCII characters. Never echoed."""
    inline = read.str(name, "")
    path = read.str(file_name, "")
    if inline and path:
        raise SettingsError(f"{name} and {file_name} are both set: use one")
    source, token = name, inline
    if path:
        source, token = file_name, _read_file(file_name, path).decode("utf-8", errors="replace").strip()
        if not token:
            raise SettingsError(f"{file_name}={path!r} is invalid: the file is empty")
    if not token:
        return b""
    # The value itself is never echoed.
    if not all(33 <= ord(char) <= 126 for char in token):
        raise SettingsError(f"{source} is invalid: only printable ASCII without spaces is allowed")
    if len(token) < MIN_TOKEN_LENGTH:
        raise SettingsError(f"{source} is invalid: must be at least {MIN_TOKEN_LENGTH} characters")
    return token.encode("ascii")


def _read_file(name: str, path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as error:
        raise SettingsError(f"{name}={path!r} is invalid: cannot read it ({error.strerror})") from None


def _read_pem(read: EnvReader, name: str, kind: str) -> bytes | None:
    path = read.str(name, "")
    if not path:
        return None
    data = _read_file(name, path)
    if b"-----BEGIN " not in data or kind.encode() not in data:
        raise SettingsError(f"{name}={path!r} is invalid: not a PEM {kind.lower()}")
    return data


# ---- credentials ----

def server_credentials(auth: InternalAuth) -> grpc.ServerCredentials | None:
    """TLS for an internal server (None: plaintext); with a CA, client
    certificates signed by it are required."""
    if auth.cert is None or auth.key is None:
        return None
    return grpc.ssl_server_credentials([(auth.key, auth.cert)], root_certificates=auth.ca,
                                       require_client_auth=auth.ca is not None)


def channel_credentials(auth: InternalAuth) -> grpc.ChannelCredentials | None:
    """TLS for an internal client (None: plaintext): servers are verified with
    the CA (the system's roots without one), and the client presents its own
    certificate when it has one."""
    if not auth.tls:
        return None
    return grpc.ssl_channel_credentials(root_certificates=auth.ca, private_key=auth.key,
                                        certificate_chain=auth.cert)


def channel_options(auth: InternalAuth) -> list[tuple[str, Any]]:
    if auth.tls and auth.server_name:
        return [("grpc.ssl_target_name_override", auth.server_name)]
    return []


# ---- the token on the server ----

def presents_token(metadata: Any, token: bytes, key: str = TOKEN_METADATA_KEY) -> bool:
    """Whether the call's metadata carries the token under `key` (compared in constant time)."""
    found = False
    for name, value in metadata or ():
        if name == key:
            presented = value if isinstance(value, bytes) else value.encode("utf-8", errors="replace")
            found |= hmac.compare_digest(presented, token)
    return found


def _service_of(method: str) -> str:
    return method.lstrip("/").split("/", 1)[0]


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call without the token (under `key`) with `code`, except the
    services in OPEN_SERVICES; with `methods`, only calls of those methods need it
    (a role's token: common/transport/worker_auth.py). Reflection is behind the token too.
    Refusals are logged with the caller's address, rate-limited (refusal_log.py)."""

    def __init__(self, token: bytes, key: str = TOKEN_METADATA_KEY,
                 code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED, message: str = DENIED_MESSAGE,
                 methods: frozenset[str] | None = None, refusals: RefusalLog | None = None) -> None:
        if not token:
            raise ValueError("TokenCheck needs a token")
        self._token = token
        self._key = key
        self._code = code
        self._message = message
        self._methods = methods
        self._refusals = refusals or RefusalLog(log, "internal call refused")

    def _guards(self, method: str) -> bool:
        if self._methods is not None:
            return method in self._methods
        return _service_of(method) not in OPEN_SERVICES

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if (not self._guards(method)
                or presents_token(handler_call_details.invocation_metadata, self._token, self._key)):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None

        def refused(peer: str) -> None:
            self._refusals.refused(peer, method, self._message)
        return _denying(handler, self._code, self._message, refused)


def _denying(handler: grpc.RpcMethodHandler, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
             message: str = DENIED_MESSAGE,
             on_refused: Callable[[str], None] | None = None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts at once with `code`,
    telling `on_refused` the caller's address first."""
    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        if on_refused is not None:
            on_refused(context.peer())
        await context.abort(code, message)

    async def deny_stream(request: object, context: grpc.aio.ServicerContext) -> Any:
        await deny(request, context)
        yield  # pragma: no cover - abort raises

    codecs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **codecs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **codecs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **codecs)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **codecs)


# ---- the token on the client ----

class _AddToken:
    def __init__(self, token: bytes, key: str) -> None:
        self._token = token.decode("ascii")
        self._key = key

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata[self._key] = self._token
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


# One class per call shape: a channel files each interceptor under one shape only.
Continuation = Callable[..., Awaitable[Any]]


class _UnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Continuation,
                                    client_call_details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Continuation,
                                     client_call_details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Continuation,
                                     client_call_details: grpc.aio.ClientCallDetails,
                                     request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Continuation,
                                      client_call_details: grpc.aio.ClientCallDetails,
                                      request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def token_interceptors(token: bytes, key: str = TOKEN_METADATA_KEY) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that add the token (under `key`) to every call (none without a token)."""
    if not token:
        return []
    return [kind(token, key) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
