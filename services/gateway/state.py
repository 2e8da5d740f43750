"""The gateway's shared dependencies and request helpers, stored on
app.state and used by every endpoint (HTTP and gRPC)."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from starlette.requests import Request

from common.observability.tracing import tracer
from services.gateway.requests.backend import GenerationSpec, SchedulerBackend
from services.gateway.text.chat_template import (
    ChatTemplateError,
    raw_prompt_ids,
    turn_stop_token_ids,
    user_turn_ids,
)
from services.gateway.dependencies import DependencyMonitor
from services.gateway.drain import Drain
from services.gateway.errors import bad_request, client_gone, model_not_found
from services.gateway.streaming.generation import GenerationService
from services.gateway.tenancy.identity import Caller
from services.gateway.models.lora_catalog import AdapterEntry, LoraCatalog, UnknownModel
from services.gateway.observability.metrics import GatewayMetrics
from services.gateway.responses.store import ResponseStore
from services.gateway.settings import GatewaySettings
from services.gateway.requests.prompt_bound import BoundedTokenizer, longest_token_chars
from services.gateway.requests.spec import Limits, TextInput, build_spec, prompt_context
from services.gateway.tenancy.tenant_quota import TenantQuotas
from services.gateway.tenancy.tenants import Tenant
from services.gateway.requests.validation import check_text
from services.gateway.text.prompt_prefixes import PromptPrefixes, SplitRule
from services.gateway.text.prompt_tokens_cache import PromptTokensCache

T = TypeVar("T")


@dataclass
class GatewayState:
    settings: GatewaySettings
    backend: SchedulerBackend
    tokenizer: Any
    service: GenerationService
    metrics: GatewayMetrics
    drain: Drain = field(default_factory=Drain)   # SIGTERM: refuse new generations, finish the rest
    quotas: TenantQuotas = field(default_factory=lambda: TenantQuotas(()))  # the service's too
    # The generations filling /v1/responses (responses/runner.py), kept until they end.
    response_tasks: set[asyncio.Task[None]] = field(default_factory=set)
    loras: LoraCatalog | None = None              # the LoRA adapters served (None: built from settings)

    @cached_property
    def responses(self) -> ResponseStore:
        """The responses kept for /v1/responses (responses/store.py)."""
        return ResponseStore(self.settings.responses_ttl_s, self.settings.responses_max_per_tenant,
                             time.monotonic)

    def __post_init__(self) -> None:
        if self.loras is None:
            settings = self.settings
            self.loras = LoraCatalog.from_modules(settings.model_names, settings.lora_modules, settings.lora_root,
                                                  settings.lora_runtime_updates)

    @cached_property
    def tokenizer_size(self) -> int:
        return len(self.tokenizer)

    @cached_property
    def longest_token_chars(self) -> int | None:
        """The length bound's characters per token (prompt_bound.py), computed once."""
        return longest_token_chars(self.tokenizer)

    @cached_property
    def dependencies(self) -> DependencyMonitor:
        """The services behind the gateway as last probed (/ready, /health, /stats, /metrics)."""
        return DependencyMonitor(self.backend, self.metrics.dependency_up)

    async def limits(self) -> Limits:
        """The MAX_MODEL_LEN setting, else the workers' context length (None
        until a worker has registered); the model's vocabulary size, else, until
        a worker has registered, the tokenizer's. MAX_TOKENS_LIMIT, else the context length,
        bounds every request's max_tokens."""
        model = await self.backend.model_info()
        max_model_len = self.settings.max_model_len or model.max_model_len
        return Limits(default_max_tokens=self.settings.default_max_tokens,
                      max_model_len=max_model_len,
                      max_tokens_limit=self.settings.max_tokens_limit or max_model_len,
                      vocab_size=model.vocab_size or self.tokenizer_size,
                      default_kv_policy=model.default_kv_policy)

    def adapter_for(self, model: str | None, tenant: Tenant | None) -> AdapterEntry | None:
        """The LoRA adapter a request's `model` names, None for the base model (a served name,
        or `model` left out); any other name is vLLM's 404, an adapter the tenant may not use
        included (lora_catalog.py)."""
        try:
            return self.loras.resolve(model, tenant)
        except UnknownModel:
            raise model_not_found(str(model)) from None

    def caller(self, tenant: Tenant | None) -> Caller:
        """Who a request comes from, as build_spec takes it."""
        return Caller(tenant, self.settings.cache_scope)

    async def text_spec(self, request: TextInput, tenant: Tenant | None) -> GenerationSpec:
        """The text API's spec (/generate, gRPC): a raw prompt is sent as is,
        else it becomes one user turn, which ends at the template's turn end."""
        build = raw_prompt_ids if request.raw else user_turn_ids
        prompt_ids = await self.tokenize(build, require_text(request.prompt), tenant=tenant,
                                         kv_policy=request.fields.kv_policy)
        stops = () if request.raw else turn_stop_token_ids(self.tokenizer)
        fields = dataclasses.replace(request.fields, stop_token_ids=stops)
        return build_spec(fields, prompt_ids, await self.limits(), self.caller(tenant))

    @cached_property
    def prompt_tokens(self) -> PromptTokensCache:
        """Recent prompts' token ids (PROMPT_TOKENS_CACHE_TOKENS, prompt_tokens_cache.py)."""
        return PromptTokensCache(self.settings.prompt_tokens_cache_tokens)

    @cached_property
    def prompt_prefixes(self) -> PromptPrefixes:
        """Recent prompts' texts and tokens by their start (prompt_prefixes.py), under the same
        bound and sharing as prompt_tokens."""
        return PromptPrefixes(SplitRule.of(self.tokenizer), self.settings.prompt_tokens_cache_tokens)

    def prompt_tokens_salt(self, tenant: Tenant | None) -> str | None:
        """Who may share a prompt's cached token ids: the prefix cache's scope (identity.py),
        `global` everyone, `tenant` the tenant's own requests; None (not cached) under `user`
        or a tenant scope without a tenant."""
        scope = self.settings.cache_scope
        if scope == "global":
            return ""
        if scope == "tenant" and tenant is not None:
            return f"tenant:{tenant.name}"
        return None

    async def tokenize(self, build: Callable[..., list[int]], *args: Any, tenant: Tenant | None,
                       param: str = "prompt", kv_policy: str | None = None) -> list[int]:
        """Runs prompt building off the event loop (long prompts take a while); a
        text too long for the context is refused by its length before it is
        tokenized (prompt_bound.py). A prompt built the same way recently, by a
        request that may share it (`tenant`), is not tokenized again."""
        salt = self.prompt_tokens_salt(tenant)
        tokenizer = await self.bounded_tokenizer(param, kv_policy, salt)
        cache = self.prompt_tokens
        key = cache.key(salt, build, args, tokenizer.bound)
        try:
            with tracer().start_as_current_span("tokenize") as span:
                ids = cache.get(key)
                span.set_attribute("fairserve.prompt_tokens_cached", ids is not None)
                if key is not None:
                    self.metrics.prompt_tokens_cache["hit" if ids is not None else "miss"].inc()
                if ids is None:
                    ids = await asyncio.to_thread(build, tokenizer, *args)
                    cache.put(key, ids)
                    if tokenizer.reused_tokens:
                        self.metrics.prompt_tokens_cache["prefix"].inc()
                    span.set_attribute("fairserve.prompt_tokens_reused", tokenizer.reused_tokens)
                span.set_attribute("fairserve.prompt_tokens", len(ids))
        except ChatTemplateError as error:
            raise bad_request(str(error), param, "invalid_messages") from None
        if not ids:
            raise bad_request("The prompt is empty.", param, "empty_prompt")
        return ids

    async def bounded_tokenizer(self, param: str, kv_policy: str | None = None,
                                salt: str | None = None) -> BoundedTokenizer:
        """The tokenizer for one prompt, refusing texts the context cannot hold; with a `salt`
        (prompt_tokens_salt), tokenizing a text only past the start it shares with a recent
        prompt of that salt."""
        context = prompt_context(await self.limits(), kv_policy)
        return BoundedTokenizer(self.tokenizer, context, self.longest_token_chars, param,
                                self.prompt_prefixes, salt)


def scheduler_request_id(trace_id: str, index: int, supplied_by_client: bool) -> str:
    """Ids the scheduler sees must be unique; a client's X-Request-ID may not be."""
    suffix = f".{secrets.token_hex(4)}" if supplied_by_client else ""
    return f"{trace_id}.{index}{suffix}"


async def prime(stream: AsyncIterator[T], request: Request) -> AsyncIterator[T]:
    """Waits for the first item so that a rejection (429, 400, 503) becomes
    the HTTP status instead of an error inside a 200 stream. A client that
    leaves meanwhile (long queue or prefill) cancels the request."""
    try:
        first = await until_disconnected(request, anext(stream))
    except StopAsyncIteration:
        first = None
        empty = True
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise
    else:
        empty = False

    async def chained() -> AsyncIterator[T]:
        try:
            if not empty:
                yield first  # type: ignore[misc]
                async for item in stream:
                    yield item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    return chained()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits generation work, cancelling it (and so the scheduler request)
    the moment the client goes away before it is done. The request body has
    been read, so the next ASGI message is the server's disconnect event."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise client_gone()
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            # Let the work unwind (its generators close) before the caller
            # touches them again.
            await asyncio.wait({task})


async def _disconnected(request: Request) -> None:
    """Returns when the server reports that the client hung up."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def require_text(value: str, param: str = "prompt") -> str:
    if not value:
        raise bad_request("The prompt is empty.", param, "empty_prompt")
    return check_text(value, param)

