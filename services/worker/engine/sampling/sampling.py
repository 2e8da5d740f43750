"""The samples of a step: the sampling rows' logits, one draw per row, by plan.

Logits come from the full LM head, or for greedy and top-k rows from the LM head
screen when the engine's accelerators plug one in and it is built (accelerators.py;
cpu/lm_head_screen.py): exact where their draw can land, -inf elsewhere, which is all
such a draw reads. An exact-match plan brings its
cached logits instead. A row after drafts draws as if they were already output.
Complete rows of whole prompts are kept for later identical prompts.
Constrained rows take the full LM head (their grammar may forbid every token a screen keeps
exact) and their grammar masks (grammar_masks.py) just before the draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.engine.accelerators import HeadScreen
from services.worker.engine.sampling.grammar_masks import PendingMasks
from services.worker.engine.model import PreparedModel
from services.worker.engine.step.planning import Planned
from services.worker.engine.sampling.prompt_logits import PromptLogitsCache
from services.worker.engine.sampling.sampler import SampledToken, SampleRequest, Sampler, tokens_drawn_from


@dataclass
class LogitsRows:
    screened: int = 0
    full: int = 0


class StepSampler:
    def __init__(self, prepared: PreparedModel, sampler: Sampler, prompt_logits: PromptLogitsCache,
                 block_size: int) -> None:
        self.lm_head = prepared.lm_head
        self.softcap = prepared.softcap
        self.screen_loader = prepared.screen
        self.sampler = sampler
        self.prompt_logits = prompt_logits
        self.block_size = block_size

    def sample(self, planned: list[Planned], sample_plans: list[Planned], hidden: torch.Tensor | None,
               logits_rows: LogitsRows, masks: PendingMasks | None = None,
               ) -> list[tuple[Planned, list[SampledToken]]]:
        """Samples of every plan that samples: one token, or one per verified row. `hidden`
        holds the final hidden states of `sample_plans`' rows; the computed logits rows are
        counted by path into `logits_rows`; `masks`, the grammar masks of constrained rows."""
        sample_plans = list(sample_plans)
        requests: list[SampleRequest] = []
        rows: list[torch.Tensor] = []
        if sample_plans:
            assert hidden is not None
            requests = _row_requests(sample_plans)
            logits, complete = self.logits(hidden, requests)
            logits_rows.screened = complete.count(False)
            logits_rows.full = len(complete) - logits_rows.screened
            rows.append(logits)
            self._keep_prompt_logits(sample_plans, logits, complete)
        reused = [p for p in planned if p.cached_logits is not None]
        if reused:
            sample_plans += reused
            requests += [p.seq.request for p in reused]
            rows.append(torch.stack([p.cached_logits for p in reused]))
        if not sample_plans:
            return []
        logits = rows[0] if len(rows) == 1 else torch.cat(rows)
        if masks is not None:
            requests = masks.attach(sample_plans, requests)
        sampled = self.sampler.sample(logits, requests)
        by_plan: dict[int, tuple[Planned, list[SampledToken]]] = {}
        for plan, token in zip(sample_plans, sampled):
            by_plan.setdefault(id(plan), (plan, []))[1].append(token)
        return list(by_plan.values())

    def logits(self, hidden: torch.Tensor, requests: list[SampleRequest]) -> tuple[torch.Tensor, list[bool]]:
        """Float32 logits [rows, vocab] of the sampling rows, and which rows are complete
        (the others are screened)."""
        screen = self.screen_loader.screen_for(len(requests))
        picks = [self._screen_pick(screen, request) for request in requests] if screen is not None else []
        screened = [row for row, pick in enumerate(picks) if pick is not None]
        screened_logits = None
        if screen is not None and 0 < len(screened) <= self.screen_loader.max_rows(screen):
            chosen = [pick for pick in picks if pick is not None]
            screened_logits = screen.logits(hidden[screened] if len(screened) < len(requests) else hidden,
                                            [count for count, _ in chosen], [ids for _, ids in chosen])
        if screened_logits is None:
            return self._full_logits(hidden), [True] * len(requests)
        complete = [pick is None for pick in picks]
        if len(screened) == len(requests):
            return screened_logits, complete
        logits = torch.empty(len(requests), screen.vocab_size, device=hidden.device)
        logits[screened] = screened_logits
        full = [row for row, pick in enumerate(picks) if pick is None]
        logits[full] = self._full_logits(hidden[full])
        return logits, complete

    def _screen_pick(self, screen: HeadScreen, request: SampleRequest) -> tuple[int, list[int]] | None:
        """(how many best tokens the row's draw reads, tokens its sampler adjusts), or None
        when the row needs its full logits."""
        count = tokens_drawn_from(request.params)
        if count is None or request.params.constraint is not None or count > screen.MAX_TOP_K or count >= screen.vocab_size:
            return None
        adjusted = self.sampler.adjusted_token_ids(request)
        if len(adjusted) > screen.MAX_ADJUSTED_TOKENS:
            return None
        return count, sorted(i for i in adjusted if 0 <= i < screen.vocab_size)

    def _full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def _keep_prompt_logits(self, sample_plans: list[Planned], logits: torch.Tensor, complete: list[bool]) -> None:
        """Keeps complete rows only: a screened row serves its own request's draw, not
        a later identical prompt that may sample differently or want logprobs."""
        if self.prompt_logits.capacity == 0:
            return
        for row, plan in enumerate(sample_plans):
            if not complete[row]:
                continue
            key = plan.seq.prompt_key(self.block_size)
            if key is not None:
                self.prompt_logits.put(key, logits[row])


def _row_requests(sample_plans: list[Planned]) -> list[SampleRequest]:
    """What each sampled row's draw sees; a plan's rows after the first come after its drafts."""
    requests: list[SampleRequest] = []
    row_index: dict[int, int] = {}
    for plan in sample_plans:
        index = row_index.get(id(plan), 0)
        row_index[id(plan)] = index + 1
        requests.append(_row_request(plan.seq.request, plan.drafts[:index]))
    return requests


def _row_request(request: SampleRequest, drafts: list[int]) -> SampleRequest:
    """What sampling the row after `drafts` sees: the request as if they were already
    its output (penalties, min_tokens and the seeded draw index follow them)."""
    if not drafts:
        return request
    return SampleRequest(params=request.params, prompt_token_ids=request.prompt_token_ids,
                         output_token_ids=[*request.output_token_ids, *drafts],
                         num_sampled=request.num_sampled + len(drafts))
