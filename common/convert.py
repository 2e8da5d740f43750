"""Translations of the messages in proto/fairserve/v1/common.proto, shared by
every service's convert module."""

from __future__ import annotations

from fairserve.v1 import common_pb2

from common.types import Constraint, ConstraintKind, SamplingParams, TokenLogprob, TopLogprob, Usage

_UINT64_MASK = (1 << 64) - 1


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        logprobs=params.logprobs, top_logprobs=params.top_logprobs,
        min_tokens=params.min_tokens, stop_token_ids=list(params.stop_token_ids),
        logit_bias=dict(params.logit_bias), prompt_logprobs=params.prompt_logprobs,
        prompt_top_logprobs=params.prompt_top_logprobs,
    )
    if params.constraint is not None:
        message.constraint.CopyFrom(constraint_to_proto(params.constraint))
    if params.seed is not None:
        # OpenAI seeds may be negative; two's complement keeps them distinct in the uint64 field.
        message.seed = params.seed & _UINT64_MASK
    return message


def sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p if 0.0 < message.top_p <= 1.0 else 1.0,
        top_k=max(0, message.top_k),
        min_p=message.min_p,
        repetition_penalty=message.repetition_penalty if message.repetition_penalty > 0 else 1.0,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        seed=message.seed if message.HasField("seed") else None,
        logprobs=message.logprobs,
        top_logprobs=max(0, message.top_logprobs),
        min_tokens=max(0, message.min_tokens),
        stop_token_ids=tuple(message.stop_token_ids),
        logit_bias=tuple(sorted(message.logit_bias.items())),
        prompt_logprobs=message.prompt_logprobs,
        prompt_top_logprobs=max(0, message.prompt_top_logprobs),
        constraint=constraint_from_proto(message.constraint) if message.HasField("constraint") else None,
    )


def constraint_to_proto(constraint: Constraint) -> common_pb2.Constraint:
    return common_pb2.Constraint(kind=common_pb2.ConstraintKind.Value("CONSTRAINT_KIND_" + constraint.kind.name),
                                 value=constraint.value, choices=list(constraint.choices))


def constraint_from_proto(message: common_pb2.Constraint) -> Constraint | None:
    """None for CONSTRAINT_KIND_NONE (and for a kind this build does not know)."""
    try:
        kind = ConstraintKind[common_pb2.ConstraintKind.Name(message.kind)[len("CONSTRAINT_KIND_"):]]
    except (KeyError, ValueError):
        return None
    return Constraint(kind=kind, value=message.value, choices=tuple(message.choices))


def logprob_to_proto(value: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        logprob=value.logprob,
        top=[common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in value.top],
        rank=value.rank,
    )


def logprob_from_proto(message: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        logprob=message.logprob,
        top=tuple(TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in message.top),
        rank=max(0, message.rank),
    )


def usage_to_proto(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                            cached_tokens=usage.cached_tokens)


def usage_from_proto(message: common_pb2.Usage) -> Usage:
    return Usage(prompt_tokens=message.prompt_tokens, completion_tokens=message.completion_tokens,
                 cached_tokens=message.cached_tokens)
