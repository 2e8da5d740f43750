"""Settings several services declare alike: the internal ports' token and TLS, the workers'
token, OpenTelemetry's standard variables, where the scheduler and the index are, the model and
its adapters, draining and the max_tokens bound. A service's schema inherits the ones it reads,
so each is declared once (common/transport/ and common/observability/tracing.py read the first
three from the environment themselves)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from common.event_loop import EVENT_LOOPS
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


class SchedulerAddrFields(SettingsSchema):
    """Where the scheduler is (the gateways and workers dial it)."""

    scheduler_addr: str = Field('127.0.0.1:50051',
        description=(
            'where the scheduler is'
        ))


class KvcacheAddrFields(SettingsSchema):
    """Where the kvcache index is."""

    kvcache_addr: str = Field('127.0.0.1:50071',
        description=(
            'where the KV index is'
        ))


class ModelFields(SettingsSchema):
    """The model the gateway and the workers load (the gateway its tokenizer)."""

    model_name: str = Field('',
        description=(
            'local Hugging Face model directory'
        ))
    model_cache_dir: str = Field('',
        description=(
            'where the converted default model lives; empty: `~/.cache/fairserve/models`'
        ))
    max_model_len: int = Field(0, ge=0,
        description=(
            'longest sequence'
        ))


class ModelKeyFields(SettingsSchema):
    """What keys a model's cached blocks (the workers and the index agree on it)."""

    model_key: str = Field('',
        description=(
            'mixed into every block hash, so stacks of different models that share one index never '
            "match each other's blocks; the same value on every service of a stack (e.g. the model "
            'name); empty: none'
        ))


class LoraFields(SettingsSchema):
    """LoRA adapters, read by the gateway and every worker."""

    lora_modules: str = Field('',
        description=(
            'LoRA adapters served beside the base model, `name=path,...` (PEFT directories, readable '
            'by the gateway and every worker); `model` names one (docs/lora.md)'
        ))
    lora_root: str = Field('',
        description=(
            'the only directory runtime-loaded adapters may come from (symlinks out of it are '
            'refused)'
        ))


class DrainFields(SettingsSchema):
    """Draining on SIGTERM."""

    drain_timeout_s: float = Field(30.0, ge=0.0,
        description=(
            'on SIGTERM, how long a draining gateway waits for its generations in flight to end (new '
            'ones get 503), and a draining worker keeps serving what no other worker could take over;'
            ' a second signal stops at once'
        ))


class MaxTokensLimitFields(SettingsSchema):
    """The bound on a request's max_tokens, held by the gateway and the scheduler."""

    max_tokens_limit: int = Field(0, ge=0,
        description=(
            'the most `max_tokens` (`max_completion_tokens`, the gRPC `max_tokens`) any request may '
            'ask for, under every KV policy, lossy ones included; above it the gateway answers 400 '
            'naming the field and the limit before queuing, and the scheduler refuses '
            '(`INVALID_ARGUMENT`, never clamps) any request that reaches it above its own; set the '
            "scheduler's at least as high as the gateways'"
        ))


class EventLoopFields(SettingsSchema):
    """EVENT_LOOP (common/event_loop.py): the asyncio loop a service's main runs on."""

    event_loop: Literal[EVENT_LOOPS] = Field("auto", description=(
        "the event loop the service runs on: `auto` uvloop where installed (it comes with "
        "uvicorn[standard]), else asyncio's; `uvloop` requires it; `asyncio` the standard loop. "
        "uvloop makes each hop of a request cheaper (on 2 cores: ~3 % more tokens/s at 32 streams, an "
        "identical cached prompt's first token ~0.5-1 ms sooner; the gateway ~5-9 MB larger)"))
