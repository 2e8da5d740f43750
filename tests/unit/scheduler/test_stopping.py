"""Finish reasons, token by token."""

from __future__ import annotations

from common.types import Constraint, ConstraintKind, SamplingParams, TokenLogprob
from services.scheduler.core.state import RequestState
from services.scheduler.core.stopping import finish_reason, take_tokens
from services.scheduler.core.types import FinishReason, RequestSpec
from tests.unit.scheduler.plain_state import make_request

EOS = frozenset({1})


def _spec(**fields: object) -> RequestSpec:
    return RequestSpec(request_id="r", prompt_token_ids=(5,), max_tokens=4, **fields)  # type: ignore[arg-type]


def test_eos_and_stop_tokens_stop_and_other_tokens_go_on() -> None:
    spec = _spec(stop_token_ids=frozenset({9}))
    assert finish_reason(spec, 4, generated=1, token_id=1, eos_token_ids=EOS) is FinishReason.STOP
    assert finish_reason(spec, 4, generated=1, token_id=9, eos_token_ids=EOS) is FinishReason.STOP
    assert finish_reason(spec, 4, generated=1, token_id=7, eos_token_ids=EOS) is None


def test_max_tokens_ends_with_length_unless_the_last_token_is_a_stop() -> None:
    spec = _spec()
    assert finish_reason(spec, 4, generated=4, token_id=7, eos_token_ids=EOS) is FinishReason.LENGTH
    assert finish_reason(spec, 4, generated=4, token_id=1, eos_token_ids=EOS) is FinishReason.STOP
    assert finish_reason(spec, 6, generated=4, token_id=7, eos_token_ids=EOS) is None   # max_tokens resolved at submit


def test_below_min_tokens_only_max_tokens_stops() -> None:
    spec = _spec(min_tokens=3, stop_token_ids=frozenset({9}))
    assert finish_reason(spec, 4, generated=2, token_id=1, eos_token_ids=EOS) is None
    assert finish_reason(spec, 4, generated=2, token_id=9, eos_token_ids=EOS) is None
    assert finish_reason(spec, 4, generated=3, token_id=9, eos_token_ids=EOS) is FinishReason.STOP
    assert finish_reason(spec, 2, generated=2, token_id=7, eos_token_ids=EOS) is FinishReason.LENGTH


def test_a_constrained_request_ends_on_eos_below_min_tokens() -> None:
    """The worker lets a grammar's EOS (a complete match) through below min_tokens; it ends the request."""
    spec = _spec(min_tokens=3, stop_token_ids=frozenset({9}),
                 sampling=SamplingParams(constraint=Constraint(ConstraintKind.REGEX, "a")))
    assert finish_reason(spec, 4, generated=1, token_id=1, eos_token_ids=EOS) is FinishReason.STOP
    assert finish_reason(spec, 4, generated=1, token_id=9, eos_token_ids=EOS) is None


def test_ignore_eos_keeps_the_stop_tokens() -> None:
    spec = _spec(ignore_eos=True, stop_token_ids=frozenset({9}))
    assert finish_reason(spec, 4, generated=1, token_id=1, eos_token_ids=EOS) is None
    assert finish_reason(spec, 4, generated=1, token_id=9, eos_token_ids=EOS) is FinishReason.STOP


def test_take_tokens_keeps_tokens_up_to_the_first_that_finishes() -> None:
    request = make_request(1, prompt=(5,), max_tokens=3)
    out, logprobs, reason = take_tokens(request, (7, 8, 9, 10), (None,), EOS)
    assert out == (7, 8, 9) and logprobs == () and reason is FinishReason.LENGTH
    assert request.output[-3:] == [7, 8, 9]       # the 10 after max_tokens is dropped, never charged
    request = make_request(2, prompt=(5,), max_tokens=10)
    out, _, reason = take_tokens(request, (7, 1, 9), (), EOS)
    assert out == (7, 1) and reason is FinishReason.STOP
    out, _, reason = take_tokens(make_request(3, prompt=(5,), max_tokens=10), (7, 8), (), EOS)
    assert len(out) == 2 and reason is None


def test_tokens_that_cannot_end_the_request_are_taken_as_one_by_one() -> None:
    """The bulk path gives what the token-by-token check gives, stops and logprobs included."""
    logprob = TokenLogprob(logprob=-0.25)
    cases = [((5, 6, 7), (logprob, None)), ((5, 9, 7), ()), ((5, 6, 1), ()), ((5, 6, 7, 8, 8, 8), ())]
    for tokens, logprobs in cases:
        for spec_fields in ({}, {"stop_token_ids": frozenset({9})}, {"ignore_eos": True}, {"min_tokens": 4}):
            spec = RequestSpec("r", (1, 2), max_tokens=8, **spec_fields)  # type: ignore[arg-type]
            request = RequestState.arriving(spec, "c", max_tokens=8, arrival_s=0.0, arrival_order=0, worker_id="w")
            request.output.extend([3, 3, 3])
            out, out_logprobs, reason = take_tokens(request, tokens, logprobs, {1})
            kept = []
            expected_reason = None
            for index, token in enumerate(tokens):
                kept.append(token)
                generated = 3 + len(kept)
                if (not spec.ignore_eos and token == 1 and generated >= spec.min_tokens) or \
                        (generated >= spec.min_tokens and token in spec.stop_token_ids):
                    expected_reason = "stop"
                    break
                if generated >= 8:
                    expected_reason = "length"
                    break
            assert list(out) == kept and request.output == [3, 3, 3, *kept]
            assert (reason.value if reason else None) == expected_reason
            expected = [logprobs[i] if i < len(logprobs) else None for i in range(len(kept))]
            assert list(out_logprobs) == (expected if any(expected) else [])   # aligned, or () when none
