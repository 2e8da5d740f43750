"""Settings several services declare alike: the internal ports' token and TLS, the workers'
token, and OpenTelemetry's standard variables. A service's schema inherits the ones it reads
(common/transport/internal_auth.py, common/transport/worker_auth.py and common/observability/tracing.py read them)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from common.settings.schema import SettingsSchema


class InternalAuthFields(SettingsSchema):
    """INTERNAL_TOKEN and the internal ports' TLS (common/transport/internal_auth.py)."""

    secrets: ClassVar[frozenset[str]] = frozenset({"internal_token"})

    internal_token: str = Field("", description=(
        "shared secret of the internal gRPC ports (scheduler, workers, kvcache): when set, they "
        "refuse calls without it (`UNAUTHENTICATED`; the health service stays open) and every "
        "service sends it; at least 16 printable characters; empty: open"))
    internal_token_file: str = Field("", description=(
        "read `INTERNAL_TOKEN` from this file instead (a Docker or Kubernetes secret)"))
    grpc_tls_cert: str = Field("", description=(
        "PEM certificate: the TLS identity of the scheduler's, workers' and kvcache's gRPC ports, "
        "and the client certificate every service presents for mutual TLS; with `GRPC_TLS_KEY`, "
        "both or neither; empty: plaintext"))
    grpc_tls_key: str = Field("", description="PEM private key of `GRPC_TLS_CERT`")
    grpc_tls_ca: str = Field("", description=(
        "PEM CA: clients verify the internal servers with it (else the system's roots); on a "
        "server it requires client certificates it signed (mutual TLS)"))
    grpc_tls_server_name: str = Field("", description=(
        "the name clients expect in the servers' certificates, for a certificate that does not "
        "name the address dialed (workers are dialed by address); empty: the host dialed"))


class WorkerTokenFields(SettingsSchema):
    """WORKER_TOKEN (common/transport/worker_auth.py): what a worker proves to register."""

    secrets: ClassVar[frozenset[str]] = frozenset({"worker_token"})

    worker_token: str = Field("", description=(
        "the workers' own token: the scheduler's `RegisterWorker`, `Heartbeat` and `DrainWorker` "
        "need it on top of `INTERNAL_TOKEN` (`PERMISSION_DENIED` without); required with "
        "`INTERNAL_TOKEN`, different from it"))
    worker_token_file: str = Field("", description="read `WORKER_TOKEN` from this file instead")


class TracingFields(SettingsSchema):
    """OpenTelemetry's standard variables (common/observability/tracing.py); tracing is off without an endpoint."""

    otel_exporter_otlp_endpoint: str = Field("", description=(
        "send OpenTelemetry traces over OTLP/HTTP there (e.g. `http://collector:4318`); empty: "
        "tracing off; the other standard `OTEL_*` variables apply"))
    otel_exporter_otlp_traces_endpoint: str = Field("", description=(
        "the traces endpoint alone (OpenTelemetry's own variable; wins over the one above)"))
    otel_service_name: str = Field("", description="the traces' service name; empty: `fairserve-<service>`")
