"""Prompt logprobs: how likely the model found each prompt token given the ones before
it, for requests that ask (SamplingParams.prompt_logprobs; /v1/completions with echo
and logprobs). The forward hands over the final hidden states of a chunk's rows that
predict a prompt token (step_inputs.ScoreRun); each row goes through the full LM head
(never the screen: the prompt token may be anywhere in the distribution) and the
log-softmax, a few rows at a time, since a row is vocabulary-sized (1 MiB of float32
on Gemma 3). Logprobs are of the raw distribution, as the sampled tokens' are; each
token's rank counts the tokens at least as likely (vLLM's rule: 1 is the argmax, ties
count against it), and its `prompt_top_logprobs` best alternatives come alongside.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.types import TokenLogprob, TopLogprob
from services.worker.engine.step.step_inputs import ScoreRun

ROWS_AT_ONCE = 64


class PromptScorer:
    def __init__(self, lm_head: Callable[[torch.Tensor], torch.Tensor], softcap: float | None) -> None:
        self.lm_head = lm_head
        self.softcap = softcap

    def __call__(self, run: ScoreRun, hidden: torch.Tensor) -> None:
        """Scores `run`'s rows (`hidden` [count, hidden]) onto its plan."""
        plan = run.plan
        top_n = plan.seq.request.params.prompt_top_logprobs
        scored: list[TokenLogprob] = []
        for first in range(0, run.count, ROWS_AT_ONCE):
            rows = hidden[first:first + ROWS_AT_ONCE]
            target = run.first_target + first
            targets = torch.tensor(plan.seq.tokens[target:target + rows.shape[0]], device=rows.device)
            scored.extend(_token_logprobs(torch.log_softmax(self._logits(rows), dim=-1), targets, top_n))
        plan.prompt_logprobs = tuple(scored)
        plan.prompt_logprobs_start = run.first_target

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _token_logprobs(logprobs: torch.Tensor, targets: torch.Tensor, top_n: int) -> list[TokenLogprob]:
    """One TokenLogprob per row of `logprobs` [rows, vocab]: its target's, ranked, with the
    `top_n` best."""
    picked = logprobs.gather(1, targets[:, None])
    ranks = (logprobs >= picked).sum(dim=-1).tolist()
    values_picked = picked[:, 0].tolist()
    if top_n <= 0:
        return [TokenLogprob(logprob=value, rank=rank) for value, rank in zip(values_picked, ranks)]
    values, ids = torch.topk(logprobs, min(top_n, logprobs.shape[-1]), dim=-1)
    return [TokenLogprob(logprob=value, rank=rank,
                         top=tuple(TopLogprob(int(i), float(v)) for i, v in zip(row_ids, row_values)))
            for value, rank, row_ids, row_values in zip(values_picked, ranks, ids.tolist(), values.tolist())]
