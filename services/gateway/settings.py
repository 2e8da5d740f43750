"""Gateway settings, read once at start from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.transport.internal_auth import InternalAuth
from common.model_files.lora_paths import AdapterPathError, parse_lora_modules
from common.model_store import default_cache_dir
from common.settings.env import SettingsError, address_list
from services.gateway.settings_schema import GatewaySchema
from services.gateway.tenancy.identity import AUTO_SCOPE, cache_scope_for
from services.gateway.models.served_names import default_served_name, served_names
from services.gateway.tenancy.tenant_config import load_tenants, read_api_keys
from services.gateway.tenancy.tenants import TenantRegistry

ONE_MIB = 1024 * 1024


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50050
    scheduler_addr: str = "127.0.0.1:50051"
    kvcache_addr: str = "127.0.0.1:50071"
    model_name: str = ""
    # SERVED_MODEL_NAME (served_names.py): what /v1/models lists and `model` must name; () is
    # MODEL_NAME's last path component.
    served_model_names: tuple[str, ...] = ()
    model_cache_dir: Path = field(default_factory=default_cache_dir)
    tenants: TenantRegistry = field(default_factory=TenantRegistry)  # API_KEYS(_FILE), ADMIN_KEYS, TENANTS_FILE
    metrics_port: int = 0           # /metrics on this port only; 0: on the public port
    # global | tenant | user | auto (unset: tenant with API keys, else global); see cache_scope
    prefix_cache_scope: str = AUTO_SCOPE
    max_request_bytes: int = ONE_MIB
    prompt_tokens_cache_tokens: int = 1 << 20   # PROMPT_TOKENS_CACHE_TOKENS (prompt_tokens_cache.py)
    default_max_tokens: int = 128
    max_model_len: int = 0          # 0: ask the workers through the scheduler
    max_tokens_limit: int = 0       # the most max_tokens any request may ask; 0: the context length
    log_level: str = "info"
    event_loop: str = "auto"      # EVENT_LOOP (common/event_loop.py)
    # What a slow or greedy client can hold: connections, and how long the
    # request line and headers, an idle keep-alive and a body may take.
    max_connections: int = 1024     # HTTP requests in flight (headers arrived); past it, 503
    max_pending_connections: int = 1024  # connections waiting for a request's headers, in all
    max_pending_per_address: int = 128   # ... from one client address
    header_timeout_s: float = 10.0
    keep_alive_s: int = 5
    body_timeout_s: float = 30.0
    max_header_bytes: int = 16 * 1024
    grpc_max_message_bytes: int = 4 * ONE_MIB
    # The public gRPC port: connections, streams per connection, calls at once.
    grpc_max_connections: int = 1024
    grpc_max_streams_per_connection: int = 100
    grpc_max_concurrent_rpcs: int = 1024
    # How long a request whose scheduler was lost waits for it to return, then
    # goes on as a continuation (continuation.py); 0: it fails at once.
    scheduler_recovery_s: float = 30.0
    scheduler_stream: str = "multiplexed"   # or per_request (streaming/scheduler_streams.py)
    scheduler_shards: tuple[str, ...] = ()  # SCHEDULER_SHARDS (streaming/shards.py); (): scheduler_addr
    internal: InternalAuth = InternalAuth()   # for its calls to the scheduler and kvcache
    drain_timeout_s: float = 30.0   # on SIGTERM, how long generations in flight may take to end
    tool_call_parser: str = "hermes"   # how chat replies' tool calls are read (tool_parsers/)
    # /v1/responses (responses/store.py): how long a finished response is kept, and how
    # many responses (in progress or kept) a tenant may have.
    responses_ttl_s: float = 3600.0
    responses_max_per_tenant: int = 100
    # LoRA adapters (lora_catalog.py): LORA_MODULES name -> directory, LORA_ROOT (where runtime
    # loads may read), LORA_RUNTIME_UPDATES (POST /v1/load_lora_adapter and /v1/unload_lora_adapter).
    lora_modules: dict[str, str] = field(default_factory=dict)
    lora_root: str = ""
    lora_runtime_updates: bool = False

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names the base model is served under, the canonical one first."""
        return self.served_model_names or (default_served_name(self.model_name),)

    @property
    def model_id(self) -> str:
        """The canonical served name: responses' `model` and the metrics' `model_name` label."""
        return self.model_names[0]

    @property
    def cache_scope(self) -> str:
        """The prefix cache scope requests get: PREFIX_CACHE_SCOPE, or when unset (auto)
        `tenant` with API keys and `global` without."""
        return cache_scope_for(self.prefix_cache_scope, self.tenants.enabled)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> GatewaySettings:
        values = GatewaySchema.read(env)
        internal = InternalAuth.from_env(env, serves=False)
        api_keys, keys_source = read_api_keys(values.api_keys, values.api_keys_file)
        settings = cls(
            host=values.gateway_host,
            port=values.gateway_port,
            grpc_port=values.gateway_grpc_port,
            scheduler_addr=values.scheduler_addr,
            kvcache_addr=values.kvcache_addr,
            model_name=values.model_name,
            served_model_names=served_names(values.served_model_name, values.model_name),
            model_cache_dir=Path(values.model_cache_dir or default_cache_dir()).expanduser(),
            # Bare keys' tenant names are keyed with the internal token, so
            # replicas sharing it name them alike.
            tenants=load_tenants(api_keys, values.tenants_file, internal.token,
                                 values.admin_keys, source=keys_source),
            metrics_port=values.metrics_port,
            prefix_cache_scope=values.prefix_cache_scope,
            max_request_bytes=values.max_request_bytes,
            prompt_tokens_cache_tokens=values.prompt_tokens_cache_tokens,
            default_max_tokens=values.default_max_tokens,
            max_model_len=values.max_model_len,
            max_tokens_limit=values.max_tokens_limit,
            log_level=values.log_level,
            event_loop=values.event_loop,
            max_connections=values.gateway_max_connections,
            max_pending_connections=values.gateway_max_pending_connections,
            max_pending_per_address=values.gateway_max_pending_per_address,
            header_timeout_s=values.gateway_header_timeout_s,
            keep_alive_s=values.gateway_keep_alive_s,
            body_timeout_s=values.gateway_body_timeout_s,
            max_header_bytes=values.gateway_max_header_bytes,
            grpc_max_message_bytes=values.gateway_grpc_max_message_bytes,
            grpc_max_connections=values.gateway_grpc_max_connections,
            grpc_max_streams_per_connection=values.gateway_grpc_max_streams_per_connection,
            grpc_max_concurrent_rpcs=values.gateway_grpc_max_concurrent_rpcs,
            scheduler_recovery_s=values.scheduler_recovery_s,
            scheduler_stream=values.scheduler_stream,
            scheduler_shards=address_list("SCHEDULER_SHARDS", values.scheduler_shards),
            responses_ttl_s=values.responses_ttl_s,
            responses_max_per_tenant=values.responses_max_per_tenant,
            internal=internal,
            drain_timeout_s=values.drain_timeout_s,
            tool_call_parser=values.tool_call_parser,
            lora_modules=_lora_modules(values.lora_modules),
            lora_root=values.lora_root,
            lora_runtime_updates=values.lora_runtime_updates,
        )
        clash = set(settings.lora_modules) & set(settings.model_names)
        if clash:
            raise SettingsError(f"LORA_MODULES adapter {sorted(clash)[0]!r} has a name of the base model "
                                "(SERVED_MODEL_NAME): give it another")
        if settings.lora_runtime_updates and not settings.lora_root:
            raise SettingsError("LORA_RUNTIME_UPDATES=true needs LORA_ROOT: the directory runtime adapter "
                                "paths must lie in")
        if settings.metrics_port and settings.metrics_port in (settings.port, settings.grpc_port):
            raise SettingsError(f"METRICS_PORT={settings.metrics_port} is invalid: it must differ "
                                "from GATEWAY_PORT and GATEWAY_GRPC_PORT")
        return settings


def _lora_modules(value: str) -> dict[str, str]:
    try:
        return parse_lora_modules(value)
    except AdapterPathError as error:
        raise SettingsError(str(error)) from None
