"""Per-request sampling over the logits of one step.

Order, as in transformers' generate, with the logit bias first as in vLLM:
logit bias -> penalties -> temperature -> top-k -> top-p -> min-p -> draw.
Greedy rows take the argmax of the penalized logits.
A constrained row's grammar mask (engine/grammar.py) sets the tokens it forbids to -inf
before the draw; the grammar wins over min_tokens (when it allows only what min_tokens
bans, EOS at the end of a match, the ban is lifted).
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
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from common.types import SamplingParams, TokenLogprob, TopLogprob


TOP_P_CANDIDATES = 1024   # top-p alone first looks for its cut among this many tokens
CDF_BLOCK = 1024
ARGMAX_BLOCKS = (256, 128, 64, 32)   # block widths row_argmax may split a row into


@dataclass
class SampleRequest:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    num_sampled: int        # tokens this request sampled before (seeds its next draw)
    grammar_bias: Any = None  # numpy float32 [vocab]: -inf where the row's grammar forbids, else 0


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
    def __init__(self, seed: int | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        self._eos_token_ids = tuple(eos_token_ids)
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
        if logits.device.type == "mps":
            logits = logits.cpu()     # the draw needs float64, which MPS lacks
        logits = logits.float()
        raw = logits
        biased = [i for i, r in enumerate(requests) if r.params.logit_bias]
        penalized = [i for i, r in enumerate(requests) if _has_penalties(r.params)]
        banned = [i for i, r in enumerate(requests) if _below_min_tokens(r)]
        masked = [i for i, r in enumerate(requests) if r.grammar_bias is not None]
        if biased or penalized or banned or masked:
            logits = logits.clone()
            for row in biased:
                _apply_logit_bias(logits[row], requests[row].params.logit_bias)
            for row in penalized:
                _apply_penalties(logits[row], requests[row])
            for row in banned:
                ids = self._banned_token_ids(requests[row].params)
                logits[row, [i for i in ids if 0 <= i < logits.shape[-1]]] = float("-inf")
            for row in masked:
                _apply_grammar_mask(logits[row], raw[row], requests[row].grammar_bias)

        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(requests) if r.params.is_greedy]
        if greedy:
            tokens[greedy] = row_argmax(_rows(logits, greedy))
        random_rows = [i for i, r in enumerate(requests) if not r.params.is_greedy]
        if random_rows:
            params = [requests[i].params for i in random_rows]
            uniforms = torch.tensor([self._uniform(requests[i]) for i in random_rows],
                                    dtype=torch.float64, device=logits.device)
            tokens[random_rows] = _sample_random(_rows(logits, random_rows), params, uniforms)

        token_list = tokens.tolist()
        logprob_rows = [i for i, r in enumerate(requests) if _wants_logprobs(r.params)]
        logprobs: dict[int, TokenLogprob] = {}
        if logprob_rows:
            row_logprobs = torch.log_softmax(_rows(raw, logprob_rows), dim=-1)
            for position, row in enumerate(logprob_rows):
                logprobs[row] = _token_logprob(row_logprobs[position], token_list[row],
                                               requests[row].params.top_logprobs)
        return [SampledToken(token, logprobs.get(row)) for row, token in enumerate(token_list)]

    def adjusted_token_ids(self, request: SampleRequest) -> set[int]:
        """Tokens whose logits this request's bias, penalties or min_tokens ban change;
        every other token's logit reaches the draw as the model computed it."""
        params = request.params
        ids: set[int] = {token_id for token_id, _ in params.logit_bias}
        if params.repetition_penalty != 1.0:
            ids.update(request.prompt_token_ids)
            ids.update(request.output_token_ids)
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            ids.update(request.output_token_ids)
        if _below_min_tokens(request):
            ids.update(self._banned_token_ids(params))
        return ids

    def _banned_token_ids(self, params: SamplingParams) -> set[int]:
        """What min_tokens bans until it is reached: EOS and the request's stop tokens."""
        return set(self._eos_token_ids) | set(params.stop_token_ids)

    def _uniform(self, request: SampleRequest) -> float:
        if request.params.seed is not None:
            return seeded_uniform(request.params.seed, request.num_sampled)
        return float(torch.rand(1, generator=self._rng, dtype=torch.float64))


def tokens_drawn_from(params: SamplingParams) -> int | None:
    """How many of a row's most likely tokens (after its penalties) its draw can pick
    from: 1 for greedy, top_k for top-k sampling; None when it needs the whole row
    (plain temperature or top-p sampling, or logprobs, which normalize over it)."""
    if _wants_logprobs(params):
        return None
    if params.is_greedy:
        return 1
    return params.top_k if params.top_k > 0 else None


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), the same indices (the first maximum; a NaN counts as the
    maximum), from a vectorized amax over blocks of each row and an argmax inside the
    first block holding the maximum. torch's argmax over a 262k vocabulary is not
    vectorized on CPU: 8 rows took ~1.8 ms, this ~0.2 ms."""
    rows, vocab = logits.shape
    width = next((block for block in ARGMAX_BLOCKS if vocab % block == 0 and vocab > block), None)
    if width is None or logits.device.type != "cpu" or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    blocks = logits.view(rows, vocab // width, width)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)
    inside = blocks[torch.arange(rows, device=logits.device), best_block].argmax(dim=-1)
    return best_block * width + inside


def _rows(matrix: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """matrix[rows] without copying a [rows, vocab] block when rows is every row."""
    if len(rows) == matrix.shape[0]:
        return matrix
    return matrix[torch.tensor(rows, device=matrix.device)]


def _has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def _below_min_tokens(request: SampleRequest) -> bool:
    return len(request.output_token_ids) < request.params.min_tokens


def _wants_logprobs(params: SamplingParams) -> bool:
    return params.logprobs or params.top_logprobs > 0


def _apply_logit_bias(row: torch.Tensor, bias: Sequence[tuple[int, float]]) -> None:
    """Adds each bias to its token's logit; ids outside the row are no tokens of this model."""
    pairs = [(token_id, value) for token_id, value in bias if 0 <= token_id < row.shape[-1]]
    if pairs:
        ids = torch.tensor([token_id for token_id, _ in pairs], device=row.device)
        row[ids] += torch.tensor([value for _, value in pairs], dtype=row.dtype, device=row.device)


def _apply_grammar_mask(row: torch.Tensor, raw: torch.Tensor, bias: np.ndarray) -> None:
    """Adds the grammar's bias (-inf where it forbids); when nothing is left (min_tokens banned
    what the grammar allows), the allowed tokens get their raw logits back. On CPU a numpy add:
    on a busy 2-vCPU machine 8 rows took ~1 ms, torch's add_ ~150 ms, masked_fill_ ~40 ms."""
    width = min(row.shape[-1], bias.shape[0])
    if row.device.type == "cpu":
        values = row.numpy()[:width]
        np.add(values, bias[:width], out=values)
        exhausted = not np.isfinite(values.max())
    else:
        row[:width] += torch.from_numpy(bias[:width]).to(row.device)
        exhausted = not bool(torch.isfinite(row.max()))
    if exhausted:
        allowed = torch.from_numpy(bias[:width] == 0).to(row.device)
        row[:width][allowed] = raw[:width][allowed]


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


def _sample_random(logits: torch.Tensor, params: Sequence[SamplingParams],
                   uniforms: torch.Tensor) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    scaled = logits / temps[:, None]
    vocab = scaled.shape[-1]
    tokens = torch.empty(len(params), dtype=torch.long, device=scaled.device)
    full = [i for i, p in enumerate(params) if not _truncates(p, vocab)]
    truncated = [i for i, p in enumerate(params) if _truncates(p, vocab)]
    if truncated:
        picked, exact = _sample_candidates(_rows(scaled, truncated), [params[i] for i in truncated],
                                           uniforms[truncated])
        tokens[truncated] = picked
        full += [row for row, ok in zip(truncated, exact.tolist()) if not ok]
    if full:
        probs = _filtered_probs(_rows(scaled, full), [params[i] for i in full])
        tokens[full] = _inverse_cdf(probs, uniforms[full])
    return tokens


def _truncates(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab or params.top_p < 1.0


def _sample_candidates(scaled: torch.Tensor, params: Sequence[SamplingParams],
                       uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast path for top-k/top-p rows: filter and draw among each row's most likely
    tokens (its top_k, or TOP_P_CANDIDATES for top-p alone) instead of the whole
    vocabulary. Returns (tokens, exact): a top-p row is exact only if its candidates
    hold more than top_p of the mass; the others must take the full path. Each row's
    result depends on its own logits only, never on the rest of the batch."""
    vocab = scaled.shape[-1]
    device = scaled.device
    limits = [p.top_k if 0 < p.top_k < vocab else min(TOP_P_CANDIDATES, vocab) for p in params]
    has_top_k = torch.tensor([0 < p.top_k < vocab for p in params], device=device)
    values, ids = scaled.topk(max(limits), dim=-1)      # sorted, most likely first
    ranks = torch.arange(values.shape[1], device=device)
    in_limit = ranks[None, :] < torch.tensor(limits, device=device)[:, None]
    # Top-k renormalizes over its k tokens; top-p alone is measured on the whole vocabulary.
    log_norm = torch.where(has_top_k, values.masked_fill(~in_limit, float("-inf")).logsumexp(dim=-1),
                           scaled.logsumexp(dim=-1))
    probs = (values - log_norm[:, None]).exp().masked_fill(~in_limit, 0.0)
    top_ps = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=device)
    min_ps = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = in_limit & (mass_before <= top_ps[:, None]) & (probs >= min_ps[:, None] * probs[:, :1])
    exact = has_top_k | (probs.sum(dim=-1) > top_ps)
    picked = _inverse_cdf(probs * keep, uniforms)
    return ids.gather(1, picked[:, None]).squeeze(1), exact


def _filtered_probs(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Full-vocabulary filtering: top-k, top-p (a full sort), min-p -> probabilities."""
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
        drop = torch.zeros_like(subset, dtype=torch.bool).scatter(1, order, mass_before > top_ps[:, None])
        scaled = scaled.clone()
        scaled[index] = subset.masked_fill(drop, float("-inf"))   # the most likely token is never dropped
    probs = scaled.softmax(dim=-1)
    min_ps = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
    if bool((min_ps > 0).any()):
        threshold = min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token whose cumulative (unnormalized) mass first exceeds uniform * total, in two
    levels: pick a block of CDF_BLOCK tokens from the block masses, then a token inside
    it. Two short cumsums instead of one over the whole vocabulary. Targets are clamped
    below each level's total so float rounding can never land on a zero-mass token."""
    rows, vocab = probs.shape
    padding = (-vocab) % CDF_BLOCK
    blocks = (F.pad(probs, (0, padding)) if padding else probs).reshape(rows, -1, CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    total = block_cdf[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, total * (1 - 1e-12))
    block = torch.searchsorted(block_cdf, target, right=True).clamp_max(block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), torch.zeros_like(target))
    inner = blocks.gather(1, block[:, :, None].expand(-1, 1, CDF_BLOCK)).squeeze(1).double().cumsum(dim=-1)
    inner_target = torch.minimum((target - before).clamp_min(0), inner[:, -1:] * (1 - 1e-12))
    offset = torch.searchsorted(inner, inner_target, right=True).clamp_max(CDF_BLOCK - 1)
    return (block * CDF_BLOCK + offset).squeeze(1)


def _token_logprob(row_logprobs: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    top: tuple[TopLogprob, ...] = ()
    if top_n > 0:
        values, ids = torch.topk(row_logprobs, min(top_n, row_logprobs.shape[-1]))
        top = tuple(TopLogprob(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()))
    return TokenLogprob(logprob=float(row_logprobs[token_id]), top=top)
