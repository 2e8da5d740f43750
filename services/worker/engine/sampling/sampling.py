"""The samples of a step: the sampling rows' logits, one draw per row, by plan.

Logits come from the full LM head, or for greedy and top-k rows from the LM head
screen when the engine's accelerators plug one in and it is built (accelerators.py;
cpu/lm_head_screen.py): exact where their draw can land, -inf elsewhere, which is all
such a draw reads. An exact-match plan brings its prompt's kept state instead
(prompt_logits.py): a kept row that serves its draw, else the final hidden state its
logits are computed from. A row after drafts draws as if they were already output.
The hidden states of rows that end whole prompts, and the rows computed from them,
are kept for later identical prompts.
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
from services.worker.engine.sampling.prompt_logits import KeptPrompt, Pick, PromptLogitsCache
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
        rows_hidden = [hidden] if sample_plans else []
        kept_of = self._keep_prompt_hidden(sample_plans, hidden) if sample_plans else {}
        # Identical prompts (planning.py, _plan_exact) bring their kept state: a kept row that
        # serves their draw, else their hidden state, whose logits are computed with the others'.
        served: dict[int, torch.Tensor] = {}
        for plan in planned:
            if plan.kept is None:
                continue
            row = plan.kept.logits_for(self._pick_of(plan.seq.request))
            if row is not None:
                served[len(sample_plans)] = row
            else:
                kept_of[len(sample_plans)] = plan.kept
                rows_hidden.append(plan.kept.hidden[None])
            sample_plans.append(plan)
        if not sample_plans:
            return []
        requests = _row_requests(sample_plans)
        computed = [row for row in range(len(sample_plans)) if row not in served]
        logits = self._assemble(requests, rows_hidden, computed, served, kept_of, logits_rows)
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

    def _assemble(self, requests: list[SampleRequest], rows_hidden: list[torch.Tensor], computed: list[int],
                  served: dict[int, torch.Tensor], kept_of: dict[int, KeptPrompt],
                  logits_rows: LogitsRows) -> torch.Tensor:
        """The logits of every sampling row: the `computed` rows' from their hidden states
        (in order), the others' kept rows; the computed rows of whole prompts are kept."""
        logits = None
        if computed:
            hidden = rows_hidden[0] if len(rows_hidden) == 1 else torch.cat(rows_hidden)
            logits, complete = self.logits(hidden, [requests[row] for row in computed])
            logits_rows.screened = complete.count(False)
            logits_rows.full = len(complete) - logits_rows.screened
            for index, row in enumerate(computed):
                if row in kept_of:
                    pick = None if complete[index] else self._pick_of(requests[row])
                    kept_of[row].keep_logits(logits[index], pick)
            if not served:
                return logits
        vocab = next(iter(served.values())).shape[0]
        every = torch.empty(len(requests), vocab, dtype=torch.float32)
        for row, kept in served.items():
            every[row] = kept
        if logits is not None:
            every[computed] = logits.float()
        return every

    def _pick_of(self, request: SampleRequest) -> Pick | None:
        """What a kept screened row must have served to serve this draw too (prompt_logits.py);
        None when the draw needs the full row."""
        count = tokens_drawn_from(request.params)
        if count is None or request.params.constraint is not None:
            return None
        return count, tuple(sorted(self.sampler.adjusted_token_ids(request)))

    def _keep_prompt_hidden(self, sample_plans: list[Planned], hidden: torch.Tensor) -> dict[int, KeptPrompt]:
        """Keeps the final hidden state of each row that ends a prompt: a later identical
        prompt computes its logits from it, for whatever draw or logprobs it asks. Returns
        the entries by row, to keep the logits computed for them too."""
        if self.prompt_logits.capacity == 0:
            return {}
        kept: dict[int, KeptPrompt] = {}
        for row, plan in enumerate(sample_plans):
            key = plan.seq.prompt_key(self.block_size)
            if key is not None:
                kept[row] = self.prompt_logits.put(key, hidden[row])
        return kept


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
