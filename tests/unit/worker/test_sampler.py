"""Sampler: greedy, penalties, filters, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from common.types import SamplingParams
from services.worker.engine.sampling.sampler import SampleRequest, Sampler, row_argmax


def _request(prompt=(), output=(), num_sampled=0, **params) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), list(prompt), list(output), num_sampled)


def _tokens(sampler: Sampler, logits: torch.Tensor, requests: list[SampleRequest]) -> list[int]:
    return [s.token_id for s in sampler.sample(logits, requests)]


def test_greedy_takes_argmax_per_row() -> None:
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 1.0, 0.0]])
    assert _tokens(Sampler(0), logits, [_request(), _request()]) == [1, 0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[3.0, 2.5, -1.0, -1.2]])
    # Token 0 seen: 3.0 / 2 = 1.5 < 2.5, so greedy moves to token 1.
    assert _tokens(Sampler(0), logits, [_request(prompt=[0], repetition_penalty=2.0)]) == [1]
    logits = torch.tensor([[-5.0, -1.0, -1.1, -6.0]])
    # Token 1 seen in the output: -1.0 * 2 = -2.0 < -1.1.
    assert _tokens(Sampler(0), logits, [_request(output=[1], repetition_penalty=2.0)]) == [2]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    sampler = Sampler(0)
    # The prompt holds token 0, but these penalties only look at the output.
    assert _tokens(sampler, logits, [_request(prompt=[0, 0], presence_penalty=1.0)]) == [0]
    assert _tokens(sampler, logits, [_request(output=[0], presence_penalty=1.0)]) == [1]
    # frequency: 2.0 - 0.2 * 3 = 1.4 < 1.5
    assert _tokens(sampler, logits, [_request(output=[0, 0, 0], frequency_penalty=0.2)]) == [1]
    assert _tokens(sampler, logits, [_request(output=[0], frequency_penalty=0.2)]) == [0]


def test_top_k_one_and_tiny_top_p_reduce_to_greedy() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(dim=-1).tolist()
    sampler = Sampler(0)
    for _ in range(5):
        assert _tokens(sampler, logits, [_request(temperature=1.0, top_k=1)] * 4) == expected
        assert _tokens(sampler, logits, [_request(temperature=1.0, top_p=1e-6)] * 4) == expected
        assert _tokens(sampler, logits, [_request(temperature=1.0, min_p=0.999)] * 4) == expected


def test_filters_only_ever_pick_allowed_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(0)
    seen_top_k, seen_top_p, seen_min_p = set(), set(), set()
    for _ in range(200):
        seen_top_k.update(_tokens(sampler, logits, [_request(temperature=1.0, top_k=2)]))
        seen_top_p.update(_tokens(sampler, logits, [_request(temperature=1.0, top_p=0.7)]))
        seen_min_p.update(_tokens(sampler, logits, [_request(temperature=1.0, min_p=0.5)]))
    assert seen_top_k == {0, 1}
    assert seen_top_p == {0, 1}     # 0.5 alone is below 0.7, so token 1 is kept too
    assert seen_min_p == {0, 1}     # 0.15 < 0.5 * 0.5


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs)[None].repeat(500, 1)
    picks = _tokens(Sampler(123), logits, [_request(temperature=1.0)] * 500)
    counts = torch.bincount(torch.tensor(picks), minlength=3).float() / 500
    assert torch.allclose(counts, probs, atol=0.07)
    # A low temperature sharpens towards the argmax.
    cold = _tokens(Sampler(123), logits, [_request(temperature=0.1)] * 500)
    assert sum(1 for token in cold if token == 0) > 490


def test_same_seed_same_tokens_whatever_shares_the_batch() -> None:
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 100, generator=generator)
    seeded = _request(temperature=1.0, seed=42, num_sampled=3)
    alone = _tokens(Sampler(1), logits[1:2], [seeded])
    crowd = [_request(temperature=0.8, top_p=0.9), seeded, _request(temperature=1.3, seed=5)]
    together = _tokens(Sampler(2), logits, crowd)
    assert together[1] == alone[0]
    # The draw advances with the number of tokens the request sampled.
    draws = {_tokens(Sampler(0), logits[1:2], [_request(temperature=1.0, seed=42, num_sampled=n)])[0]
             for n in range(30)}
    assert len(draws) > 1


def test_logprobs_come_from_the_raw_distribution() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    sampled = Sampler(0).sample(logits, [_request(output=[2], repetition_penalty=3.0, logprobs=True,
                                                  top_logprobs=2)])[0]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert sampled.token_id == 1          # penalized 3.0 / 3 = 1.0 < 2.0
    assert sampled.logprob is not None
    assert math.isclose(sampled.logprob.logprob, float(raw[1]), abs_tol=1e-6)
    assert [top.token_id for top in sampled.logprob.top] == [2, 1]
    assert math.isclose(sampled.logprob.top[0].logprob, float(raw[2]), abs_tol=1e-6)
    assert Sampler(0).sample(logits, [_request()])[0].logprob is None


def test_top_p_draws_the_same_token_set_on_the_candidate_and_the_full_path() -> None:
    from services.worker.engine.sampling.sampler import TOP_P_CANDIDATES, _sample_random

    vocab = 4 * TOP_P_CANDIDATES
    generator = torch.Generator().manual_seed(3)
    peaked = torch.full((vocab,), -30.0)
    peaked[[7, 900, 3000]] = torch.tensor([2.0, 1.5, 1.0])     # its candidates cover top_p
    flat = torch.randn(vocab, generator=generator) * 0.01        # they do not: full sort
    params = [SamplingParams(temperature=1.0, top_p=0.8)] * 2
    seen: list[set[int]] = [set(), set()]
    for uniform in torch.linspace(0, 1, 401, dtype=torch.float64).tolist():
        picked = _sample_random(torch.stack([peaked, flat]), params, torch.tensor([uniform, uniform],
                                                                                  dtype=torch.float64))
        seen[0].add(int(picked[0]))
        seen[1].add(int(picked[1]))
    probs = peaked.softmax(dim=-1)
    assert probs[7] + probs[900] > 0.8 > probs[7]
    assert seen[0] == {7, 900}
    # The flat row keeps about 80% of its tokens; draws spread over well past the candidates.
    assert len(seen[1]) > 300 and max(seen[1]) > TOP_P_CANDIDATES


def test_draws_never_pick_zero_mass_tokens_across_cdf_blocks() -> None:
    from services.worker.engine.sampling.sampler import CDF_BLOCK, _inverse_cdf

    vocab = 3 * CDF_BLOCK + 17          # not a multiple of the block: the padding must never win
    probs = torch.zeros(7, vocab)
    allowed = [5, CDF_BLOCK - 1, CDF_BLOCK, 2 * CDF_BLOCK + 3, vocab - 1]
    probs[:, allowed] = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    # Cumulative masses 0.1 0.3 0.6 0.85 1.0; a uniform of exactly 1 is clamped to the last token.
    uniforms = torch.tensor([0.0, 0.05, 0.2, 0.35, 0.7, 0.9, 1.0], dtype=torch.float64)
    picked = _inverse_cdf(probs, uniforms).tolist()
    assert picked == [5, 5, CDF_BLOCK - 1, CDF_BLOCK, 2 * CDF_BLOCK + 3, vocab - 1, vocab - 1]


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    from common.types import SamplingParams
    from services.worker.engine.sampling.sampler import SampleRequest, Sampler

    logits = torch.zeros(2, 8)
    logits[:, 1] = 10.0   # EOS is by far the likeliest
    logits[:, 5] = 9.0    # then a stop token
    logits[:, 3] = 8.0
    params = SamplingParams(min_tokens=2, stop_token_ids=(5,))
    sampler = Sampler(eos_token_ids=[1])
    early = SampleRequest(params, [0], [4], num_sampled=1)
    done = SampleRequest(params, [0], [4, 4], num_sampled=2)
    tokens = [t.token_id for t in sampler.sample(logits, [early, done])]
    assert tokens == [3, 1]


@pytest.mark.parametrize("vocab", [262144, 1024, 384, 96, 37, 1])
def test_row_argmax_gives_torchs_indices(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator)
    logits[1] = float("-inf")                                   # nothing finite: index 0
    logits[2, vocab // 3] = logits[2, vocab - 1] = 50.0         # a tie: the first one wins
    logits[3, vocab // 2] = float("nan")                        # NaN counts as the maximum
    logits[4] = 1.0                                             # all equal
    logits[5, -1] = float("inf")
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(row_argmax(logits[:, ::1][[0, 2]]), logits[[0, 2]].argmax(dim=-1))
    strided = logits.t().contiguous().t()                       # not contiguous: torch's own argmax
    assert torch.equal(row_argmax(strided), logits.argmax(dim=-1))


def test_logit_bias_is_added_before_the_draw() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])
    sampler = Sampler(0)
    # +1 on token 1 makes it the argmax; -100 bans the argmax; +100 forces a tail token.
    assert _tokens(sampler, logits, [_request(logit_bias=((1, 1.0),))]) == [1]
    assert _tokens(sampler, logits, [_request(logit_bias=((0, -100.0),))]) == [1]
    for seed in range(20):
        assert _tokens(sampler, logits, [_request(temperature=1.0, seed=seed,
                                                  logit_bias=((3, 100.0),))]) == [3]
    # Ids past the row are ignored; other rows of the batch are untouched.
    rows = logits.repeat(2, 1)
    assert _tokens(sampler, rows, [_request(logit_bias=((0, -100.0), (99, 50.0))), _request()]) == [1, 0]


def test_logit_bias_leaves_reported_logprobs_raw_and_marks_its_tokens_adjusted() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    request = _request(logprobs=True, logit_bias=((2, 100.0),))
    [token] = Sampler(0).sample(logits, [request])
    assert token.token_id == 2
    assert token.logprob is not None and math.isclose(token.logprob.logprob, math.log(0.1), rel_tol=1e-5)
    assert Sampler(0).adjusted_token_ids(_request(logit_bias=((7, 1.0), (2, -3.0)))) == {2, 7}
