"""The worker role's credential. `WORKER_TOKEN` (or `WORKER_TOKEN_FILE`) is held
only by the workers and by the scheduler, which requires it, on top of
`INTERNAL_TOKEN`, on the RPCs only a worker makes: RegisterWorker, Heartbeat and
DrainWorker (PERMISSION_DENIED without it). Every service holds INTERNAL_TOKEN,
the internet-facing gateway included; with it alone, anyone who took the
gateway could register a worker of its own and receive every tenant's prompts.
The gateway and kvcache never read it.

With INTERNAL_TOKEN set, WORKER_TOKEN is required (the scheduler and the
workers refuse to start without it) and must differ from it; with neither set
(tests, a laptop) every port stays open as before."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

import grpc
from fairserve.v1 import scheduler_pb2

from common.transport.internal_auth import TokenCheck, read_token, token_interceptors
from common.settings.env import EnvReader, SettingsError

WORKER_TOKEN_METADATA_KEY = "x-fairserve-worker-token"
WORKER_DENIED_MESSAGE = "missing or invalid worker token"
_SCHEDULER = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"]
# The scheduler's RPCs only a worker makes (named from the proto, so a rename fails here).
WORKER_METHODS = frozenset(f"/{_SCHEDULER.full_name}/{_SCHEDULER.methods_by_name[name].name}"
                           for name in ("RegisterWorker", "Heartbeat", "DrainWorker"))


def worker_token_from_env(env: Mapping[str, str], internal_token: bytes) -> bytes:
    """WORKER_TOKEN or WORKER_TOKEN_FILE, checked against the internal token."""
    token = read_token(EnvReader(env), "WORKER_TOKEN", "WORKER_TOKEN_FILE")
    if internal_token and not token:
        raise SettingsError(
            "WORKER_TOKEN is missing: with INTERNAL_TOKEN set, the worker RPCs (RegisterWorker, Heartbeat, "
            "DrainWorker) need a token of their own, held only by the scheduler and the workers: set "
            "WORKER_TOKEN or WORKER_TOKEN_FILE on both (e.g. `openssl rand -hex 32`), never on the gateway")
    if token and internal_token and hmac.compare_digest(token, internal_token):
        raise SettingsError("WORKER_TOKEN is invalid: it must differ from INTERNAL_TOKEN, "
                            "which every service, the gateway included, holds")
    return token


def worker_role_check(token: bytes) -> list[grpc.aio.ServerInterceptor]:
    """The scheduler's check of the worker RPCs (none without a token)."""
    if not token:
        return []
    return [TokenCheck(token, key=WORKER_TOKEN_METADATA_KEY, code=grpc.StatusCode.PERMISSION_DENIED,
                       message=WORKER_DENIED_MESSAGE, methods=WORKER_METHODS)]


def worker_token_interceptors(token: bytes) -> list[grpc.aio.ClientInterceptor]:
    """For a worker's channel to the scheduler: the worker token on every call."""
    return token_interceptors(token, WORKER_TOKEN_METADATA_KEY)
