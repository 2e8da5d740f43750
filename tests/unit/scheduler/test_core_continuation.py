"""A continuation (a request whose first scheduler was lost, resubmitted with the
tokens it had streamed) runs as a request preempted after them: the worker gets
them as output, only the tokens after them are streamed, max_tokens and
min_tokens count them, it goes first, and it neither times out in the queue
nor waits for a shared prefix. Steps carry the epoch of their worker's registration."""

from __future__ import annotations

from dataclasses import replace

from common.sequence_ids import request_id_of

from services.scheduler.core.types import CoreConfig, FinishReason, Gate

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.harness import Harness

PROMPT = tuple(range(30, 50))


def test_a_continuation_streams_the_rest_of_what_the_request_would_have_streamed() -> None:
    h = Harness(CoreConfig(), FakeEngine())
    expected = reference_output(PROMPT, 12)
    request_id = h.submit(PROMPT, max_tokens=12, resume_token_ids=tuple(expected[:5])).request_id
    h.run()
    stream = h.streams[request_id]
    assert stream.token_ids == expected[5:]
    assert stream.finish is not None and stream.finish.reason is FinishReason.LENGTH
    usage = stream.finish.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), 12)
    [first] = h.plans["w0"][0].new_sequences
    assert first.prompt_token_ids == PROMPT and first.output_token_ids == tuple(expected[:5])


def test_the_worker_recomputes_it_from_the_cached_prefix() -> None:
    engine = FakeEngine()
    h = Harness(CoreConfig(), engine)
    expected = reference_output(PROMPT, 10)
    first = h.submit(PROMPT, max_tokens=10).request_id
    h.run()
    assert h.streams[first].token_ids == expected
    again = h.submit(PROMPT, max_tokens=10, resume_token_ids=tuple(expected[:6])).request_id
    h.run()
    assert h.streams[again].token_ids == expected[6:]
    # The blocks the first run left cached cover the prompt and the resumed tokens.
    assert h.streams[again].finish.usage.cached_tokens == len(PROMPT)
    assert engine.pool().used_blocks == 0


def test_min_tokens_and_the_sampling_the_worker_gets_count_the_resumed_tokens() -> None:
    h = Harness(CoreConfig(), FakeEngine())
    expected = reference_output(PROMPT, 8)
    request_id = h.submit(PROMPT, max_tokens=8, min_tokens=6, stop_token_ids=frozenset({expected[4]}),
                          resume_token_ids=tuple(expected[:3])).request_id
    h.run()
    # The stop token comes 5th (total): below min_tokens it does not stop the request.
    assert h.streams[request_id].token_ids == expected[3:]
    [new] = h.plans["w0"][0].new_sequences
    assert new.sampling.min_tokens == 6 and new.sampling.stop_token_ids == (expected[4],)


def test_it_goes_first_and_never_times_out_in_the_queue() -> None:
    h = Harness(CoreConfig(max_batch_size=1, queue_timeout_s=1.0), FakeEngine())
    running = h.submit(PROMPT, max_tokens=30).request_id
    h.step()
    fresh = h.submit(PROMPT[::-1], max_tokens=4).request_id
    continued = h.submit(PROMPT[1:], max_tokens=6, resume_token_ids=(3, 4)).request_id
    h.run()
    assert h.streams[continued].finish_step < h.streams[fresh].first_token_step
    assert h.streams[continued].token_ids == reference_output(PROMPT[1:] + (3, 4), 4)
    late = h.submit(PROMPT, max_tokens=30).request_id
    h.step()
    waiting = h.submit(PROMPT[2:], max_tokens=4).request_id
    resumed = h.submit(PROMPT[3:], max_tokens=4, resume_token_ids=(9,)).request_id
    h.clock.advance(5.0)
    h.deliver(h.core.expire().updates)
    assert h.streams[waiting].rejection is not None and h.streams[waiting].rejection.gate is Gate.TIMEOUT
    assert h.streams[resumed].rejection is None
    h.run()
    assert h.streams[late].finish is not None and len(h.streams[resumed].token_ids) == 3


def test_it_never_waits_for_a_shared_prefix_being_prefilled() -> None:
    h = Harness(CoreConfig(prefill_chunk_size=4, prefix_wait_min_tokens=8), FakeEngine())
    h.submit(PROMPT, max_tokens=4)
    h.step()                      # the leader prefills 4 tokens a step
    fresh = h.submit(PROMPT, max_tokens=4).request_id
    continued = h.submit(PROMPT, max_tokens=4, resume_token_ids=(3,)).request_id
    h.step()
    admitted = {request_id_of(new.seq_id) for new in h.plans["w0"][-1].new_sequences}
    assert continued in admitted and fresh not in admitted


def test_resumed_tokens_must_leave_room_for_one_more() -> None:
    h = Harness(CoreConfig(), FakeEngine(max_model_len=64))
    result = h.submit(PROMPT, max_tokens=4, resume_token_ids=(5, 6, 7, 8))
    assert result.rejection is not None and result.rejection.gate is Gate.NEVER_FIT
    assert "resumes" in result.rejection.message
    # max_tokens <= 0: the context's room, which the resumed tokens count against.
    full = h.submit(PROMPT, max_tokens=0, resume_token_ids=tuple(range(64 - len(PROMPT))))
    assert full.rejection is not None and full.rejection.gate is Gate.NEVER_FIT
    fits = h.submit(PROMPT, max_tokens=0, resume_token_ids=tuple(range(63 - len(PROMPT))))
    assert fits.accepted
    h.run()
    assert len(h.streams[fits.request_id].token_ids) == 1


def test_steps_carry_the_epoch_of_their_workers_registration() -> None:
    engine = FakeEngine()
    h = Harness(CoreConfig(), engine)
    h.core.add_worker(replace(engine.spec("w0"), epoch=41))
    h.submit(PROMPT, max_tokens=3)
    h.run()
    assert {plan.epoch for plan in h.plans["w0"]} == {41}
