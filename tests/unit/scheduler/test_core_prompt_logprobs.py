"""Prompt logprobs through the scheduling core: the worker reports each chunk's scored
prompt positions; the client gets the whole prompt's (positions 1 on) once, with its
first tokens, whatever the chunking, preemptions or failovers in between."""

from __future__ import annotations

from dataclasses import replace

from common.types import SamplingParams, TokenLogprob
from services.scheduler.core.types import CoreConfig
from common.step import SeqResult, StepBatch, StepOutput

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.harness import Harness

PROMPT = tuple(range(10, 31))


class ScoringEngine(FakeEngine):
    """Scores the prompt positions each work item computes, as the worker does for a sequence
    with prompt_logprobs: position p gets logprob -p (no prefix caching, so every one is)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(prefix_caching=False, **kwargs)
        self.prompt_len: dict[str, int] = {}

    def step(self, plan: StepBatch) -> StepOutput:
        for new in plan.new_sequences:
            if new.sampling.prompt_logprobs:
                self.prompt_len[new.seq_id] = len(new.prompt_token_ids)
        before = {seq_id: seq.computed for seq_id, seq in self.seqs.items()}
        out = super().step(plan)
        return replace(out, results=tuple(self._scored(result, before.get(result.seq_id, 0))
                                          for result in out.results))

    def _scored(self, result: SeqResult, computed_before: int) -> SeqResult:
        length = self.prompt_len.get(result.seq_id)
        if length is None or result.error:
            return result
        last = min(result.num_computed_tokens, length - 1)
        start = computed_before + 1
        scored = tuple(TokenLogprob(logprob=-float(p)) for p in range(start, last + 1))
        return replace(result, prompt_logprobs=scored, prompt_logprobs_start=start) if scored else result


def test_the_prompt_logprobs_come_once_with_the_first_tokens_over_chunks() -> None:
    h = Harness(CoreConfig(prefill_chunk_size=6), ScoringEngine())
    rid = h.submit(PROMPT, max_tokens=3, sampling=SamplingParams(prompt_logprobs=True)).request_id
    plain = h.submit(PROMPT, max_tokens=3).request_id
    h.run()
    stream = h.streams[rid]
    assert [logprob.logprob for logprob in stream.prompt_logprobs] == [-float(p) for p in range(1, len(PROMPT))]
    assert stream.token_ids == reference_output(PROMPT, 3)
    assert h.streams[plain].prompt_logprobs == []


def test_a_request_preempted_after_its_first_tokens_sends_them_once() -> None:
    # A pool too small for both: one is preempted and recomputed (its prompt scored again).
    h = Harness(CoreConfig(prefill_chunk_size=8), ScoringEngine(num_blocks=14, block_size=4))
    ids = [h.submit(PROMPT, max_tokens=24, sampling=SamplingParams(prompt_logprobs=True)).request_id
           for _ in range(2)]
    h.run()
    assert h.core.stats().preemptions > 0
    for rid in ids:
        assert len(h.streams[rid].prompt_logprobs) == len(PROMPT) - 1
        assert h.streams[rid].token_ids == reference_output(PROMPT, 24)
