"""Gateway settings, read once at start from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.internal_auth import InternalAuth
from common.lora_paths import AdapterPathError, parse_lora_modules
from common.model_store import default_cache_dir
from common.settings import EnvReader, SettingsError
from services.gateway.identity import AUTO_SCOPE, CACHE_SCOPES, cache_scope_for
from services.gateway.served_names import default_served_name, served_names
from services.gateway.tenant_config import load_tenants, read_api_keys
from services.gateway.tenants import TenantRegistry
from services.gateway.tool_parsers import PARSERS

ONE_MIB = 1024 * 1024
LOG_LEVELS = ("debug", "info", "warning", "error")


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
    default_max_tokens: int = 128
    max_model_len: int = 0          # 0: ask the workers through the scheduler
    max_tokens_limit: int = 0       # the most max_tokens any request may ask; 0: the context length
    log_level: str = "info"
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
        read = EnvReader(env)
        internal = InternalAuth.from_env(env, serves=False)
        api_keys, keys_source = read_api_keys(read.str("API_KEYS", ""), read.str("API_KEYS_FILE", ""))
        settings = cls(
            host=read.str("GATEWAY_HOST", cls.host),
            port=read.port("GATEWAY_PORT", cls.port),
            grpc_port=read.port("GATEWAY_GRPC_PORT", cls.grpc_port),
            scheduler_addr=read.str("SCHEDULER_ADDR", cls.scheduler_addr),
            kvcache_addr=read.str("KVCACHE_ADDR", cls.kvcache_addr),
            model_name=read.str("MODEL_NAME", cls.model_name),
            served_model_names=served_names(read.str("SERVED_MODEL_NAME", ""), read.str("MODEL_NAME", "")),
            model_cache_dir=Path(read.str("MODEL_CACHE_DIR", str(default_cache_dir()))).expanduser(),
            # Bare keys' tenant names are keyed with the internal token, so
            # replicas sharing it name them alike.
            tenants=load_tenants(api_keys, read.str("TENANTS_FILE", ""), internal.token,
                                 read.str("ADMIN_KEYS", ""), source=keys_source),
            metrics_port=read.port("METRICS_PORT", cls.metrics_port),
            prefix_cache_scope=read.choice("PREFIX_CACHE_SCOPE", cls.prefix_cache_scope,
                                           (AUTO_SCOPE, *CACHE_SCOPES)),
            max_request_bytes=read.int("MAX_REQUEST_BYTES", cls.max_request_bytes, minimum=1024),
            default_max_tokens=read.int("DEFAULT_MAX_TOKENS", cls.default_max_tokens, minimum=1),
            max_model_len=read.int("MAX_MODEL_LEN", cls.max_model_len, minimum=0),
            max_tokens_limit=read.int("MAX_TOKENS_LIMIT", cls.max_tokens_limit, minimum=0),
            log_level=read.choice("LOG_LEVEL", cls.log_level, LOG_LEVELS),
            max_connections=read.int("GATEWAY_MAX_CONNECTIONS", cls.max_connections, minimum=1),
            max_pending_connections=read.int("GATEWAY_MAX_PENDING_CONNECTIONS",
                                             cls.max_pending_connections, minimum=1),
            max_pending_per_address=read.int("GATEWAY_MAX_PENDING_PER_ADDRESS",
                                             cls.max_pending_per_address, minimum=1),
            header_timeout_s=read.float("GATEWAY_HEADER_TIMEOUT_S", cls.header_timeout_s,
                                        minimum=0.1),
            keep_alive_s=read.int("GATEWAY_KEEP_ALIVE_S", cls.keep_alive_s, minimum=1),
            body_timeout_s=read.float("GATEWAY_BODY_TIMEOUT_S", cls.body_timeout_s, minimum=0.1),
            max_header_bytes=read.int("GATEWAY_MAX_HEADER_BYTES", cls.max_header_bytes,
                                      minimum=1024),
            grpc_max_message_bytes=read.int("GATEWAY_GRPC_MAX_MESSAGE_BYTES",
                                            cls.grpc_max_message_bytes, minimum=1024,
                                            maximum=64 * ONE_MIB),
            grpc_max_connections=read.int("GATEWAY_GRPC_MAX_CONNECTIONS", cls.grpc_max_connections,
                                          minimum=1),
            grpc_max_streams_per_connection=read.int("GATEWAY_GRPC_MAX_STREAMS_PER_CONNECTION",
                                                     cls.grpc_max_streams_per_connection, minimum=1),
            grpc_max_concurrent_rpcs=read.int("GATEWAY_GRPC_MAX_CONCURRENT_RPCS",
                                              cls.grpc_max_concurrent_rpcs, minimum=1),
            scheduler_recovery_s=read.float("SCHEDULER_RECOVERY_S", cls.scheduler_recovery_s, minimum=0.0),
            responses_ttl_s=read.float("RESPONSES_TTL_S", cls.responses_ttl_s, minimum=1.0),
            responses_max_per_tenant=read.int("RESPONSES_MAX_PER_TENANT", cls.responses_max_per_tenant,
                                              minimum=1),
            internal=internal,
            drain_timeout_s=read.float("DRAIN_TIMEOUT_S", cls.drain_timeout_s, minimum=0.0),
            tool_call_parser=read.choice("TOOL_CALL_PARSER", cls.tool_call_parser, tuple(PARSERS)),
            lora_modules=_lora_modules(read.str("LORA_MODULES", "")),
            lora_root=read.str("LORA_ROOT", ""),
            lora_runtime_updates=read.bool("LORA_RUNTIME_UPDATES", False),
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
