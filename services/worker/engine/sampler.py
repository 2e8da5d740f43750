"""Per-request sampling over the logits of one step.

Order, as in transformers' generate: penalties -> temperature -> top-k -> top-p
-> min-p -> draw. Greedy rows take the argmax of the penalized logits.
Reported logprobs come from the raw model distribution (log_softmax of the
unprocessed logits), like vLLM's default.

A seeded request draws its uniform from a generator seeded with
hash(seed, tokens sampled so far), so its text depends only on its own seed
and history, never on what else shares the batch. Draws are inverse-CDF over
the filtered distribution: one uniform per token, whatever the vocabulary.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.types import SamplingParams, TokenLogprob, TopLogprob


@dataclass
class SampleRequest:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    num_sampled: int        # tokens this request sampled before (seeds its next draw)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None


def seeded_uniform(seed: int, draw_index: int) -> float:
    digest = hashlib.blake2b(struct.pack("<qq", seed & ((1 << 63) - 1), draw_index), digest_size=8).digest()
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return float(torch.rand(1, generator=generator, dtype=torch.float64))


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = torch.Generator()
        if seed is None:
            self._rng.seed()
        else:
            self._rng.manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> list[SampledToken]:
        """logits [S, V] (one row per request) -> one token per request."""
        if logits.shape[0] != len(requests):
            raise ValueError("one logits row per request")
        if not requests:
            return []
        logits = logits.float()
        raw = logits
        penalized = [i for i, r in enumerate(requests) if _has_penalties(r.params)]
        if penalized:
            logits = logits.clone()
            for row in penalized:
                _apply_penalties(logits[row], requests[row])

        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(requests) if r.params.is_greedy]
        if greedy:
            index = torch.tensor(greedy, device=logits.device)
            tokens[index] = logits[index].argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            params = [requests[i].params for i in random_rows]
            probs = _filtered_probs(logits[index], params)
            uniforms = torch.tensor([self._uniform(requests[i]) for i in random_rows],
                                    dtype=probs.dtype, device=probs.device)
            tokens[index] = _inverse_cdf(probs, uniforms)

        token_list = tokens.tolist()
        logprob_rows = [i for i, r in enumerate(requests) if _wants_logprobs(r.params)]
        logprobs: dict[int, TokenLogprob] = {}
        if logprob_rows:
            index = torch.tensor(logprob_rows, device=logits.device)
            row_logprobs = torch.log_softmax(raw[index], dim=-1)
            for position, row in enumerate(logprob_rows):
                logprobs[row] = _token_logprob(row_logprobs[position], token_list[row],
                                               requests[row].params.top_logprobs)
        return [SampledToken(token, logprobs.get(row)) for row, token in enumerate(token_list)]

    def _uniform(self, request: SampleRequest) -> float:
        if request.params.seed is not None:
            return seeded_uniform(request.params.seed, request.num_sampled)
        return float(torch.rand(1, generator=self._rng, dtype=torch.float64))


def _has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def _wants_logprobs(params: SamplingParams) -> bool:
    return params.logprobs or params.top_logprobs > 0


def _apply_penalties(row: torch.Tensor, request: SampleRequest) -> None:
    params = request.params
    if params.repetition_penalty != 1.0:
        seen = list(request.prompt_token_ids) + list(request.output_token_ids)
        if seen:
            ids = torch.tensor(seen, device=row.device).unique()
            values = row[ids]
            penalty = params.repetition_penalty
            row[ids] = torch.where(values > 0, values / penalty, values * penalty)
    if (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0) and request.output_token_ids:
        ids, counts = torch.tensor(list(request.output_token_ids), device=row.device).unique(return_counts=True)
        row[ids] -= params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    scaled = logits / temps[:, None]
    vocab = scaled.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_ks) < vocab:
        largest = torch.topk(scaled, max(top_ks), dim=-1).values
        kth = largest.gather(1, torch.tensor(top_ks, device=scaled.device)[:, None] - 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if top_p_rows:
        index = torch.tensor(top_p_rows, device=scaled.device)
        top_ps = torch.tensor([params[i].top_p for i in top_p_rows], dtype=scaled.dtype, device=scaled.device)
        subset = scaled[index]
        sorted_logits, order = subset.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before > top_ps[:, None]     # always keeps the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled[index] = subset.masked_fill(drop, float("-inf"))
    probs = scaled.softmax(dim=-1)
    min_ps = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
    if bool((min_ps > 0).any()):
        threshold = min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(dim=-1)
    targets = uniforms.double()[:, None] * cdf[:, -1:]
    # right=True picks the first token whose cumulative mass exceeds the target, never a zero-mass one.
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return picked.clamp_max(probs.shape[-1] - 1)


def _token_logprob(row_logprobs: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    top: tuple[TopLogprob, ...] = ()
    if top_n > 0:
        values, ids = torch.topk(row_logprobs, min(top_n, row_logprobs.shape[-1]))
        top = tuple(TopLogprob(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()))
    return TokenLogprob(logprob=float(row_logprobs[token_id]), top=top)
