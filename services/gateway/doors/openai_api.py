"""OpenAI-compatible endpoints: /v1/models, /v1/completions and
/v1/chat/completions, streaming and not, with n choices and logprobs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from common.types import Usage
from services.gateway.requests.backend import BackendError, GenerationSpec
from services.gateway.requests.chat_request import call_reader, constrain_tool_call, read_chat
from services.gateway.text.chat_template import (
    chat_prompt_ids,
    raw_prompt_ids,
    turn_stop_token_ids,
    with_special_tokens,
)
from services.gateway.requests.echo import Echo, echoed, prompt_texts
from services.gateway.errors import bad_request, from_backend
from services.gateway.streaming.generation import TextDelta, merge_streams
from services.gateway.models.lora_catalog import with_adapter
from services.gateway.doors.openai_format import (
    ChatFormat,
    ChoiceResult,
    CompletionFormat,
    Format,
    RequestInfo,
)
from services.gateway.requests.prompt_scores import check_prompt_logprobs, scoring
from services.gateway.requests.schemas import (
    ChatCompletionBody,
    CompletionBody,
    ModelCard,
    ModelList,
)
from services.gateway.requests.spec import RequestFields, build_spec
from services.gateway.doors.sse import DONE, event_stream, sse_data
from services.gateway.requests.structured import body_constraint
from services.gateway.state import (
    GatewayState,
    prime,
    require_text,
    scheduler_request_id,
    until_disconnected,
)
from services.gateway.requests.unsupported import reject_unsupported
from services.gateway.tenancy.tenants import Tenant
from services.gateway.requests.validation import (
    MAX_TOP_LOGPROBS,
    SamplingInput,
    check_int,
    check_n,
)

router = APIRouter(prefix="/v1")
CallReader = Callable[[AsyncIterator[tuple[int, TextDelta]], int], AsyncIterator[tuple[int, TextDelta]]]
MAX_CHOICES = 64
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "bad values"}, 401: {"description": "missing or wrong API key"},
    413: {"description": "body too large"}, 422: {"description": "schema error"},
    429: {"description": "queue full"}, 503: {"description": "not ready"}}


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


@dataclass(frozen=True)
class Choice:
    index: int
    prompt_index: int
    spec: GenerationSpec
    echo: Echo | None = None     # /v1/completions with echo: the prompt comes first


def _echo_choices(state: GatewayState, body: CompletionBody, prompts: Sequence[list[int]],
                  choices: list[Choice]) -> list[Choice]:
    """`choices` echoing their prompts, scored when logprobs are asked for."""
    texts = prompt_texts(state.tokenizer, body.prompt, prompts)
    echoed_choices = [dataclasses.replace(choice, echo=Echo(
        texts[choice.prompt_index], tuple(prompts[choice.prompt_index]), body.max_tokens != 0, body.logprobs or 0))
        for choice in choices]
    return _scoring_prompts(echoed_choices, body.logprobs)


def _scoring_prompts(choices: list[Choice], alternatives: int | None) -> list[Choice]:
    """`choices` scoring their prompts with `alternatives` per token (None: as they were)."""
    if alternatives is None:
        return choices
    return [dataclasses.replace(choice, spec=scoring(choice.spec, alternatives)) for choice in choices]


def _request_info(request: Request, state: GatewayState, model: str | None = None) -> RequestInfo:
    """The request's identity and the model it asked for: the base model (by any served name, or
    `model` left out; responses name it by the canonical one), or a LoRA adapter the caller may
    use (any other `model` is a 404, an adapter the tenant may not use included)."""
    request_id = getattr(request.state, "request_id", "")
    tenant = getattr(request.state, "tenant", None)
    adapter = state.adapter_for(model, tenant)
    return RequestInfo(request_id=request_id,
                       supplied=bool(getattr(request.state, "request_id_supplied", False)),
                       tenant=tenant, created=int(time.time()),
                       model=adapter.name if adapter is not None else state.settings.model_id, adapter=adapter)


@router.get("/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    """The base model under each of its served names (root: the canonical one, never a path),
    then the LoRA adapters the caller may use, each with the canonical name as parent."""
    state = _state(request)
    base_id = state.settings.model_id
    max_model_len = (await state.limits()).max_model_len
    created = int(time.time())
    cards = [ModelCard(id=name, created=created, max_model_len=max_model_len, root=base_id)
             for name in state.settings.model_names]
    cards += [ModelCard(id=entry.name, created=entry.created, max_model_len=max_model_len, root=entry.name,
                        parent=base_id)
              for entry in state.loras.visible(getattr(request.state, "tenant", None))]
    return ModelList(data=cards)


@router.post("/completions", responses=_ERRORS)
async def completions(body: CompletionBody, request: Request) -> Response:
    state = _state(request)
    info = _request_info(request, state, body.model)
    reject_unsupported(body.model_extra)
    check_int("logprobs", body.logprobs, 0, MAX_TOP_LOGPROBS)
    prompt_alternatives = check_prompt_logprobs(body.prompt_logprobs, bool(body.stream))
    prompts = await _completion_prompts(state, body.prompt, body.add_special_tokens, body.kv_policy, info.tenant)
    fields = completion_fields(body)
    if body.echo and body.max_tokens == 0:
        fields = dataclasses.replace(fields, max_tokens=1)   # scores the prompt only (echo.py)
    choices = await _choices(state, prompts, fields, check_n(body.n), info)
    if body.echo:
        choices = _echo_choices(state, body, prompts, choices)
    choices = _scoring_prompts(choices, prompt_alternatives)
    response_id = f"cmpl-{info.request_id}"
    formatter = CompletionFormat(state, response_id, info, logprobs=body.logprobs is not None,
                                 prompt_logprobs=prompt_alternatives)
    return await _respond(request, state, info, choices, bool(body.stream),
                          _include_usage(body.stream_options), formatter)


@router.post("/chat/completions", responses=_ERRORS)
async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
    state = _state(request)
    info = _request_info(request, state, body.model)
    reject_unsupported(body.model_extra)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    prompt_alternatives = check_prompt_logprobs(body.prompt_logprobs, bool(body.stream))
    chat = read_chat(body, state.tokenizer)
    prompt_ids = await state.tokenize(chat_prompt_ids, chat.messages, chat.template_tools,
                                      tenant=info.tenant, param="messages", kv_policy=body.kv_policy)
    if body.add_special_tokens:
        prompt_ids = with_special_tokens(state.tokenizer, prompt_ids)
    fields = constrain_tool_call(chat_fields(body, turn_stop_token_ids(state.tokenizer)), chat)
    choices = _scoring_prompts(await _choices(state, [prompt_ids], fields, check_n(body.n), info),
                               prompt_alternatives)
    formatter = ChatFormat(state, f"chatcmpl-{info.request_id}", info, bool(body.logprobs),
                           prompt_logprobs=prompt_alternatives)
    return await _respond(request, state, info, choices, bool(body.stream),
                          _include_usage(body.stream_options), formatter,
                          call_reader(chat, state.settings.tool_call_parser, bool(body.stream)))


def _include_usage(options: Any) -> bool:
    return bool(options is not None and options.include_usage)


def completion_fields(body: CompletionBody) -> RequestFields:
    """What a /v1/completions body asks for: its prompts are sent as they are."""
    return _request_fields(body, _sampling_input(body, logprobs=body.logprobs is not None,
                                                 top_logprobs=body.logprobs),
                           max_tokens=body.max_tokens)


def chat_fields(body: ChatCompletionBody, turn_stop_ids: tuple[int, ...]) -> RequestFields:
    """What a /v1/chat/completions body asks for: the reply ends with the turn."""
    sampling = _sampling_input(body, logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs)
    newer = body.max_completion_tokens is not None  # OpenAI's newer name wins
    return _request_fields(
        body, sampling, max_tokens=body.max_completion_tokens if newer else body.max_tokens,
        max_tokens_param="max_completion_tokens" if newer else "max_tokens",
        prompt_param="messages", stop_token_ids=turn_stop_ids)


def _request_fields(body: CompletionBody | ChatCompletionBody, sampling: SamplingInput,
                    **door: Any) -> RequestFields:
    return RequestFields(sampling=sampling, default_temperature=1.0, stop=body.stop,
                         ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                         priority=body.priority, session_id=body.session_id, user=body.user,
                         requested_stop_token_ids=body.stop_token_ids,
                         logit_bias=body.logit_bias, kv_policy=body.kv_policy, **body_constraint(body), **door)


def _sampling_input(body: CompletionBody | ChatCompletionBody, logprobs: bool,
                    top_logprobs: int | None) -> SamplingInput:
    return SamplingInput(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, seed=body.seed, logprobs=logprobs,
        top_logprobs=top_logprobs)


async def _completion_prompts(state: GatewayState, prompt: Any, add_special_tokens: bool,
                              kv_policy: str | None, tenant: Tenant | None) -> list[list[int]]:
    """The prompts as token ids; ids a client gave are checked in build_spec."""
    if isinstance(prompt, str):
        return [await state.tokenize(raw_prompt_ids, require_text(prompt), add_special_tokens,
                                     tenant=tenant, kv_policy=kv_policy)]
    if not prompt:
        raise bad_request("The prompt is empty.", "prompt", "empty_prompt")
    if isinstance(prompt[0], int):   # one prompt of token ids: its length is no count of prompts
        return [list(prompt)]
    if len(prompt) > MAX_CHOICES:
        raise bad_request(f"At most {MAX_CHOICES} prompts per request, got {len(prompt)}.", "prompt")
    if isinstance(prompt[0], list):
        return [list(ids) for ids in prompt]
    return [await state.tokenize(raw_prompt_ids, require_text(text), add_special_tokens,
                                 tenant=tenant, kv_policy=kv_policy) for text in prompt]


async def _choices(state: GatewayState, prompts: Sequence[list[int]], fields: RequestFields,
                   n: int, info: RequestInfo) -> list[Choice]:
    if n * len(prompts) > MAX_CHOICES:
        raise bad_request(f"n times the number of prompts must be at most {MAX_CHOICES}, "
                          f"got {n * len(prompts)}.", "n")
    limits = await state.limits()
    caller = state.caller(info.tenant)
    choices: list[Choice] = []
    for prompt_index, prompt_ids in enumerate(prompts):
        spec = with_adapter(build_spec(fields, prompt_ids, limits, caller), info.adapter)
        for sample in range(n):
            choices.append(Choice(len(choices), prompt_index, _nth_sample(spec, sample)))
    return choices


def _nth_sample(spec: GenerationSpec, sample: int) -> GenerationSpec:
    """Distinct but reproducible seeds, so n > 1 gives n different samples."""
    seed = spec.sampling.seed
    if seed is None or sample == 0:
        return spec
    return dataclasses.replace(spec, sampling=dataclasses.replace(spec.sampling, seed=seed + sample))


async def _respond(request: Request, state: GatewayState, info: RequestInfo,
                   choices: list[Choice], stream: bool, include_usage: bool,
                   formatter: Format, read_calls: CallReader | None = None) -> Response:
    streams = [state.service.stream(choice.spec,
                                    scheduler_request_id(info.request_id, choice.index, info.supplied),
                                    info.request_id)
               for choice in choices]
    streams = [echoed(stream, choice.echo) if choice.echo is not None else stream
               for stream, choice in zip(streams, choices)]
    merged = merge_streams(streams)
    if read_calls is not None:
        merged = read_calls(merged, len(choices))
    try:
        if stream:
            events = _stream_events(await prime(merged, request), choices, include_usage, formatter)
            return event_stream(events)
        results = await until_disconnected(request, _collect(merged, len(choices)))
    except BackendError as error:
        raise from_backend(error) from None
    for choice, result in zip(choices, results):
        result.prompt_token_ids = choice.spec.prompt_token_ids
    return JSONResponse(formatter.response(results, _total_usage(choices, results)))


async def _collect(merged: AsyncIterator[tuple[int, TextDelta]], count: int) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(count)]
    async with aclosing(merged):  # type: ignore[type-var]
        async for index, delta in merged:
            result = results[index]
            result.text.append(delta.text)
            result.tokens.extend(delta.tokens)
            result.tool_calls.extend(delta.tool_calls)
            result.prompt_logprobs = delta.prompt_logprobs or result.prompt_logprobs
            if delta.finish_reason is not None:
                result.finish_reason = delta.finish_reason
                result.usage = delta.usage or result.usage
    return results


def _total_usage(choices: Sequence[Choice], results: Sequence[ChoiceResult]) -> Usage:
    prompt_tokens: dict[int, int] = {}
    cached_tokens: dict[int, int] = {}
    for choice, result in zip(choices, results):
        prompt_tokens[choice.prompt_index] = len(choice.spec.prompt_token_ids)
        cached_tokens[choice.prompt_index] = max(cached_tokens.get(choice.prompt_index, 0),
                                                 result.usage.cached_tokens)
    return Usage(prompt_tokens=sum(prompt_tokens.values()),
                 completion_tokens=sum(result.usage.completion_tokens for result in results),
                 cached_tokens=sum(cached_tokens.values()))


async def _stream_events(merged: AsyncIterator[tuple[int, TextDelta]], choices: Sequence[Choice],
                         include_usage: bool, formatter: Format) -> AsyncIterator[bytes]:
    results = [ChoiceResult() for _ in choices]
    started: set[int] = set()
    try:
        async with aclosing(merged):  # type: ignore[type-var]
            async for index, delta in merged:
                if index not in started:
                    started.add(index)
                    opening = formatter.opening_chunk(index, include_usage)
                    if opening is not None:
                        yield sse_data(opening)
                if delta.text or delta.tool_calls or (formatter.logprobs and delta.tokens):
                    yield sse_data(formatter.delta_chunk(index, delta, include_usage))
                if delta.finish_reason is not None:
                    results[index].finish_reason = delta.finish_reason
                    results[index].usage = delta.usage or results[index].usage
                    yield sse_data(formatter.finish_chunk(index, delta.finish_reason, include_usage))
        if include_usage:
            yield sse_data(formatter.usage_chunk(_total_usage(choices, results)))
    except BackendError as error:
        yield sse_data(from_backend(error).body())
    yield DONE
