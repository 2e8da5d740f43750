"""The one request shape. Each front door (/generate, the OpenAI endpoints,
the gRPC text API) says what its client asked for as RequestFields, and
build_spec checks them into the GenerationSpec that generation.py streams
and convert.py sends to the scheduler. Every failed check is a 400 that
names the field."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.grammar import ConstraintError, check
from common.step import KV_POLICIES
from common.types import Constraint
from services.gateway.requests.backend import GenerationSpec
from services.gateway.errors import bad_request
from services.gateway.tenancy.identity import Caller, cap_priority, resolve_identity
from services.gateway.requests.token_controls import check_logit_bias, check_stop_token_ids
from services.gateway.requests.validation import (
    SamplingInput,
    build_sampling,
    check_min_tokens,
    check_priority,
    check_prompt_ids,
    normalize_stop,
    resolve_max_tokens,
)


@dataclass(frozen=True)
class RequestFields:
    """A request's parameters as its client gave them, not yet checked.
    max_tokens is the budget asked for (None: the default); the *_param
    names are what errors call the fields at this door."""
    sampling: SamplingInput = SamplingInput()
    default_temperature: float = 0.0    # the text API is greedy by default, OpenAI's is not
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    prompt_param: str = "prompt"
    stop: str | Sequence[str] | None = None
    stop_token_ids: tuple[int, ...] = ()  # the door's: the chat template's end of turn (EOS-like)
    requested_stop_token_ids: Sequence[int] | None = None  # the client's, checked here
    logit_bias: Mapping[str, float] | None = None
    kv_policy: str | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    priority: int | None = None
    session_id: str | None = None
    user: str | None = None
    constraint: Constraint | None = None  # structured output (structured.py reads it from a body)
    constraint_param: str = "response_format"  # the field that asked for it, for errors


@dataclass(frozen=True)
class TextInput:
    """A text API request (/generate, gRPC): a prompt, as is when raw, else
    one user turn of the chat template."""
    prompt: str
    raw: bool
    fields: RequestFields


@dataclass(frozen=True)
class Limits:
    """What requests are checked against: the gateway's default budget, the
    context length (None while unknown), the vocabulary size, and the most
    max_tokens any request may ask for, whatever its KV policy (MAX_TOKENS_LIMIT,
    else the context length; None while unknown)."""
    default_max_tokens: int
    max_model_len: int | None
    vocab_size: int | None
    default_kv_policy: str = "full"     # what a request naming no kv_policy gets (KV_POLICY)
    max_tokens_limit: int | None = None


def build_spec(fields: RequestFields, prompt_ids: Sequence[int], limits: Limits,
               caller: Caller = Caller()) -> GenerationSpec:
    """The one way a request becomes a GenerationSpec, at every door."""
    identity = resolve_identity(fields.session_id, fields.user, caller)
    check_prompt_ids(prompt_ids, limits.vocab_size, fields.prompt_param)
    sampling = dataclasses.replace(
        build_sampling(fields.sampling, fields.default_temperature),
        logit_bias=check_logit_bias(fields.logit_bias, limits.vocab_size),
        constraint=check_constraint(fields))
    # The door's end-of-turn ids act as EOS, so ignore_eos waives them (as vLLM does the
    # generation config's extra EOS ids); the client's own stop_token_ids still apply.
    implicit = () if fields.ignore_eos else fields.stop_token_ids
    stop_token_ids = tuple(dict.fromkeys((*implicit, *check_stop_token_ids(
        fields.requested_stop_token_ids, limits.vocab_size))))
    stop = normalize_stop(fields.stop)
    priority = cap_priority(check_priority(fields.priority), caller)
    kv_policy = check_kv_policy(fields.kv_policy)
    # A lossy KV policy (the request's, else the deployment's) keeps positions within its
    # cache: the model's context does not bound it.
    context = prompt_context(limits, kv_policy)
    max_tokens = resolve_max_tokens(fields.max_tokens, len(prompt_ids), limits.default_max_tokens,
                                    context, fields.max_tokens_param, limits.max_tokens_limit)
    if sampling.constraint is not None and fields.ignore_eos:
        raise bad_request("ignore_eos cannot be combined with a constrained output: the output ends "
                          "where the grammar does.", "ignore_eos")
    return GenerationSpec(
        prompt_token_ids=tuple(prompt_ids), max_tokens=max_tokens, sampling=sampling, stop=stop,
        stop_token_ids=stop_token_ids, ignore_eos=bool(fields.ignore_eos),
        min_tokens=check_min_tokens(fields.min_tokens, max_tokens),
        client_id=identity.client_id, session_id=identity.session_id, priority=priority,
        user=identity.user, weight=identity.weight, cache_salt=identity.cache_salt, kv_policy=kv_policy,
        tenant_limits=caller.tenant.limits if caller.tenant is not None else None)


def prompt_context(limits: Limits, kv_policy: str | None) -> int | None:
    """The context a prompt must fit: the model's under the full KV policy (the
    request's, else the deployment's); none under a lossy one, which keeps positions
    within its cache."""
    return limits.max_model_len if (kv_policy or limits.default_kv_policy) == "full" else None


def check_kv_policy(kv_policy: str | None) -> str:
    if kv_policy is None:
        return ""
    if kv_policy not in KV_POLICIES:
        raise bad_request(f"kv_policy must be one of {', '.join(KV_POLICIES)}, got {kv_policy!r}.", "kv_policy")
    return kv_policy


def check_constraint(fields: RequestFields) -> Constraint | None:
    """The request's constraint, compiled once here so that a bad schema, regex or grammar is a
    400 naming the problem before anything is queued."""
    if fields.constraint is None:
        return None
    try:
        check(fields.constraint)
    except ConstraintError as error:
        raise bad_request(f"{fields.constraint_param}: {error}", fields.constraint_param,
                          "invalid_constraint") from None
    return fields.constraint
