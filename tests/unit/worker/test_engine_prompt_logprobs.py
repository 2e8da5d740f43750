"""Prompt logprobs (SamplingParams.prompt_logprobs): every prompt token's logprob and rank
given the ones before it, with prompt_top_logprobs alternatives (not top_logprobs, the
sampled tokens' count), against a full transformers forward; chunked
prefills report their own positions; a scored prompt reuses no cached block."""

from __future__ import annotations

import torch

from common.types import SamplingParams
from common.step import NewSequence, StepBatch, WorkItem
from tests.unit.worker.engine_helpers import Driver, make_engine, prompt_of

ATOL = 1e-4


def _reference_logprobs(reference: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _score(driver: Driver, seq_id: str, prompt: list[int], chunk: int, top: int = 0) -> dict[int, object]:
    """Prefills `prompt` in chunks of `chunk`; the scored positions -> their TokenLogprob."""
    params = SamplingParams(logprobs=True, top_logprobs=1, prompt_logprobs=True, prompt_top_logprobs=top)
    new = [NewSequence(seq_id, tuple(prompt), (), params)]
    scored: dict[int, object] = {}
    while True:
        out = driver.step(StepBatch(new_sequences=new, work=[WorkItem(seq_id, chunk)]))
        new = []
        (result,) = out.results
        for offset, logprob in enumerate(result.prompt_logprobs):
            position = result.prompt_logprobs_start + offset
            assert position not in scored
            scored[position] = logprob
        if result.sampled:
            return scored


def test_prompt_logprobs_match_a_full_forward_in_any_chunking(kind: str, reference: torch.nn.Module) -> None:
    engine = make_engine(kind)
    driver = Driver(engine)
    prompt = prompt_of(23, 3)
    expected = _reference_logprobs(reference, prompt)
    for chunk in (1024, 5, 4):
        scored = _score(driver, f"s{chunk}", prompt, chunk, top=3)
        assert sorted(scored) == list(range(1, len(prompt)))
        for position, logprob in scored.items():
            row = expected[position - 1]
            assert abs(logprob.logprob - float(row[prompt[position]])) < ATOL
            target = row[prompt[position]]   # ranked among the tokens at least as likely
            assert int((row > target + ATOL).sum()) < logprob.rank <= int((row >= target - ATOL).sum())
            values, ids = torch.topk(row, 3)
            assert [top.token_id for top in logprob.top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([top.logprob for top in logprob.top]), values,
                                       atol=ATOL, rtol=0)
        driver.step(StepBatch(free_seq_ids=[f"s{chunk}"]))


def test_a_scored_prompt_computes_every_position_even_when_cached(kind: str) -> None:
    engine = make_engine(kind, enable_prefix_caching=True)
    driver = Driver(engine)
    prompt = prompt_of(21, 5)
    driver.run({"warm": prompt}, 2)     # its full blocks are now cached
    new = NewSequence("scored", tuple(prompt), (), SamplingParams(prompt_logprobs=True))
    out = driver.step(StepBatch(new_sequences=[new], work=[WorkItem("scored", 1024)]))
    (result,) = out.results
    assert result.num_cached_tokens == 0 and out.batch_tokens == len(prompt)
    assert result.prompt_logprobs_start == 1 and len(result.prompt_logprobs) == len(prompt) - 1
    assert all(not logprob.top for logprob in result.prompt_logprobs)


def test_without_prompt_logprobs_nothing_is_scored(kind: str) -> None:
    driver = Driver(make_engine(kind))
    new = NewSequence("plain", tuple(prompt_of(9, 1)), (), SamplingParams(logprobs=True))
    out = driver.step(StepBatch(new_sequences=[new], work=[WorkItem("plain", 1024)]))
    assert out.results[0].prompt_logprobs == ()
