"""The gateway's settings.

One field per environment variable (the name in capitals): its type, default, bounds and meaning.
`GatewaySettings` builds the running settings from it; `fairserve gateway --help`, `fairserve config`
and docs/config.md are generated from it (common/settings/schema.py).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from common.observability.logs import LOG_LEVELS
from services.gateway.tenancy.identity import AUTO_SCOPE, CACHE_SCOPES
from services.gateway.tool_parsers import PARSERS

from common.settings.shared import (
    InternalAuthFields, TracingFields, SchedulerAddrFields, KvcacheAddrFields, ModelFields,
    LoraFields, DrainFields, MaxTokensLimitFields, EventLoopFields,
)


class GatewaySchema(
        InternalAuthFields, TracingFields, SchedulerAddrFields, KvcacheAddrFields,
        ModelFields, LoraFields, DrainFields, MaxTokensLimitFields, EventLoopFields,
):
    service: ClassVar[str] = "gateway"
    advanced: ClassVar[frozenset[str]] = frozenset({
        "event_loop",
        "gateway_max_pending_connections",
        "gateway_max_pending_per_address",
        "gateway_header_timeout_s",
        "gateway_keep_alive_s",
        "gateway_body_timeout_s",
        "gateway_max_header_bytes",
        "gateway_grpc_max_message_bytes",
        "gateway_grpc_max_connections",
        "gateway_grpc_max_streams_per_connection",
        "gateway_grpc_max_concurrent_rpcs",
        "scheduler_stream",
        "scheduler_shards",
    })
    secrets: ClassVar[frozenset[str]] = InternalAuthFields.secrets | {"api_keys", "admin_keys"}
    api_keys: str = Field('',
        description=(
            'comma-separated `name=key` entries or bare keys; when set, requests need `Authorization:'
            " Bearer <key>` (or `x-api-key: <key>`; gRPC: the same metadata) and the key's tenant is "
            'the fairness client: `name`, or for a bare key `key-` and 12 hex digits of its '
            'HMAC-SHA256 (keyed with `INTERNAL_TOKEN` when set, so replicas agree). `user` (else '
            '`session_id`) is then the end user within the tenant. No key is ever logged or shown in '
            '`/stats` or metrics'
        ))
    api_keys_file: str = Field('',
        description=(
            'read the `API_KEYS` entries from this file instead (one a line or comma-separated; `#` '
            'starts a comment line), so keys need not sit in the environment; setting both is an '
            'error naming both'
        ))
    gateway_host: str = Field('127.0.0.1',
        description=(
            'the HTTP (and gRPC text API) listen address'
        ))
    gateway_port: int = Field(8000, ge=0, le=65535,
        description=(
            'the HTTP port: the OpenAI-compatible API, /generate, the dashboard'
        ))
    gateway_grpc_port: int = Field(50050, ge=0, le=65535,
        description=(
            'gRPC text API'
        ))
    served_model_name: str = Field('',
        description=(
            'the names clients use for the model, comma-separated (vLLM\'s `--served-model-name`): '
            'what `/v1/models` lists and what a request\'s `model` must match (any other name is a '
            '404); the first is the name responses and metrics carry; empty: `MODEL_NAME`\'s last '
            'path component (`gemma-3-270m` for the default model)'
        ))
    metrics_port: int = Field(0, ge=0, le=65535,
        description=(
            "serve the gateway's `/metrics` on this port only (same host); the API port then answers "
            '404 there'
        ))
    prefix_cache_scope: Literal[(AUTO_SCOPE, *CACHE_SCOPES)] = Field('auto',
        description=(
            'who may reuse whose cached prefix blocks: `tenant`, only requests of the same client '
            '(the tenant, with keys); `user`, only those of the same client and end user (`user`, '
            'else `session_id`); `global`, everyone. `global` with keys is an opt-in with a risk: a '
            "tenant can read another's prompt token by token from its own "
            '`usage.prompt_tokens_details.cached_tokens` and its timings (the gateway logs a warning)'
        ))
    prompt_tokens_cache_tokens: int = Field(1048576, ge=0,
        description=(
            'token ids of recent prompts the gateway keeps (4 bytes each, least recently used '
            'dropped first), so that a prompt sent again (best-of and pass@k clients, retries) is '
            'not tokenized again, and, with their texts, so that a prompt starting as a recent one '
            'did is tokenized only past that start (the same bound again); entries are shared as '
            '`PREFIX_CACHE_SCOPE` shares cached prefixes (per tenant with keys, so no tenant times '
            'another\'s prompts; not kept under `user`); 0: off'
        ))
    max_request_bytes: int = Field(1048576, ge=1024,
        description=(
            'larger bodies get 413'
        ))
    default_max_tokens: int = Field(128, ge=1,
        description=(
            "`max_tokens` of a request that gives none (OpenAI's legacy completions default to 16; "
            'chat has no limit but the context)'
        ))
    log_level: Literal[LOG_LEVELS] = Field('info',
        description=(
            'JSON logs on stderr'
        ))
    gateway_max_connections: int = Field(1024, ge=1,
        description=(
            'HTTP requests in flight at most (headers arrived, response not finished); past it '
            'requests get 503. Connections still waiting for headers are capped apart'
        ))
    gateway_max_pending_connections: int = Field(1024, ge=1,
        description=(
            "HTTP connections waiting for a request's headers (new, half sent, or idle between "
            'keep-alive requests) at most; past it the oldest of the client address holding the most '
            'is closed'
        ))
    gateway_max_pending_per_address: int = Field(128, ge=1,
        description=(
            "the same from one client address; past it that address's oldest waiting connection is "
            'closed, so a flood of half-open connections costs its sender its own and never takes '
            "complete requests' slots. Behind a proxy every client shares its address: raise it above"
            " the proxy's idle upstream connections"
        ))
    gateway_header_timeout_s: float = Field(10.0, ge=0.1,
        description=(
            'a connection whose request line and headers have not all arrived this long after it '
            "opened (or after its last response) is closed; also the public gRPC port's handshake "
            'deadline'
        ))
    gateway_keep_alive_s: int = Field(5, ge=1,
        description=(
            'an idle keep-alive connection is closed after this'
        ))
    gateway_body_timeout_s: float = Field(30.0, ge=0.1,
        description=(
            'a request body that takes longer to arrive gets 408'
        ))
    gateway_max_header_bytes: int = Field(16384, ge=1024,
        description=(
            'largest incomplete request head buffered; past it 400'
        ))
    gateway_grpc_max_message_bytes: int = Field(4194304, ge=1024, le=64 * 1024 * 1024,
        description=(
            'largest message the gRPC text API takes; larger ones get `RESOURCE_EXHAUSTED`'
        ))
    gateway_grpc_max_connections: int = Field(1024, ge=1,
        description=(
            'connections the public gRPC port accepts at once (idle ones close after 300 s; metadata '
            'is bounded by `GATEWAY_MAX_HEADER_BYTES`)'
        ))
    gateway_grpc_max_streams_per_connection: int = Field(100, ge=1,
        description=(
            'concurrent calls on one gRPC connection (HTTP/2 `MAX_CONCURRENT_STREAMS`)'
        ))
    gateway_grpc_max_concurrent_rpcs: int = Field(1024, ge=1,
        description=(
            'calls in flight on the public gRPC port; past it `RESOURCE_EXHAUSTED`'
        ))
    scheduler_stream: Literal['multiplexed', 'per_request'] = Field('multiplexed',
        description=(
            'how requests travel to the scheduler: `multiplexed`, all of them over one gRPC call '
            '(`GenerateMany`), the scheduler writing one message per step for every request that '
            'made tokens; `per_request`, a `Generate` call each, a message per token (what older '
            'gateways do; the scheduler serves both at once)'
        ))
    scheduler_shards: str = Field('',
        description=(
            'scheduler shards, comma-separated `host:port` (each serving its own workers, named in '
            "one another's `SCHEDULER_PEERS`; docs/scaling.md): a request goes to its session's or "
            "user's shard, else to the shard whose worker holds the longest cached prefix of its prompt "
            "(the kvcache index) unless that shard is overloaded, else the one with the fewest of this "
            "gateway's requests in flight; a shard that is lost is passed over for 2 s. Empty: "
            '`SCHEDULER_ADDR` alone'
        ))
    scheduler_recovery_s: float = Field(30.0, ge=0.0,
        description=(
            'when the connection to the scheduler fails mid-request (a crash or restart; its refusals'
            ' do not count), how long the gateway keeps retrying; once the scheduler is back, each '
            'request goes on where it stopped, resubmitted as a continuation from the tokens already '
            'streamed (no gap, no repeat, the usage of an undisturbed run). Past it, or with `0`, the'
            ' request fails as before: 503, or an error event in a stream already started'
        ))
    responses_ttl_s: float = Field(3600.0, ge=1.0,
        description=(
            'how long a finished `/v1/responses` response is kept for retrieval, resume and '
            '`previous_response_id`'
        ))
    responses_max_per_tenant: int = Field(100, ge=1,
        description=(
            'responses (in progress or kept) one tenant may have; past it a create is a 429'
        ))
    tool_call_parser: Literal[tuple(PARSERS)] = Field('hermes',
        description=(
            'how chat replies are read for tool calls (`services/gateway/tool_parsers/`): `hermes` '
            'reads `<tool_call>{"name", "arguments"}</tool_call>`, the convention of Hermes and Qwen '
            'chat templates and of the built-in turn format'
        ))
    lora_runtime_updates: bool = Field(False,
        description=(
            '`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (operator keys only under '
            '`API_KEYS`; open without keys: risk, docs/lora.md); needs `LORA_ROOT`'
        ))
    tenants_file: str = Field('',
        description=(
            'JSON, or YAML for `.yaml`/`.yml`: `{"defaults": {...}, "tenants": {"<name>": {...}}}` '
            'with `weight` (VTC share, > 0; default 1), `max_priority` (higher requested priorities '
            'are lowered to it; default 0), `max_in_flight` (generations waiting or running; default '
            '64 for every keyed tenant, `null`: no limit), `max_queued` (accepted, no first token '
            'yet), `requests_per_s` with `burst` (generations started; each of `n` choices counts; '
            "each `/tokenize` and `/detokenize` call counts one, against the gateway's own bucket), "
            '`tokens_per_minute` (prompt plus output tokens; the prompt is charged at admission, '
            'output as it streams; a prompt larger than the whole budget is a 400) and '
            '`max_request_s` (a generation still running this long after it reached the scheduler '
            'ends with `finish_reason: "length"`, its text kept); `lora_adapters` lists the LoRA '
            'adapters a tenant may name (`"*"`: all; unset: none, admins all). The scheduler holds '
            'the limits for all gateways together (N replicas give a tenant the limits of one); past '
            'one that tenant alone gets 429 with `Retry-After` (the refill time for rates and '
            "tokens). A field left out takes `defaults`' value; `null` means no limit. Needs "
            '`API_KEYS`, and every tenant named needs a key'
        ))
    admin_keys: str = Field('',
        description=(
            'operator keys, same syntax as `API_KEYS`: valid API keys of operator tenants (names of '
            'their own, not in `API_KEYS`) whose `/stats` shows every tenant; `admin: true` on a '
            "tenant in `TENANTS_FILE` does the same. Any other key's `/stats` shows only its tenant's"
            ' clients, users and counters (docs/metrics.md)'
        ))
