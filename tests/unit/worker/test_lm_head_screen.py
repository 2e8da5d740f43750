"""The LM head screen: its error bound holds, and greedy / top-k draws over its rows
pick exactly what they pick over the full float32 logits, penalties included; with the
C kernel's int16 activation rows and with fbgemm's two 7-bit grid rows alike."""

from __future__ import annotations

import pytest
import torch

from common.types import SamplingParams
from services.worker.engine.cpu.screen import lm_head_screen
from services.worker.engine.cpu.screen.int8_matmul import NATIVE_TILE, NativeInt8Matmul
from services.worker.engine.cpu.screen.lm_head_screen import LMHeadScreen, load_native_matmul
from services.worker.engine.cpu.screen.screen_fbgemm import screening_available
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.sampling.sampler import SampleRequest, Sampler, tokens_drawn_from

VOCAB, HIDDEN = 6000, 64


def lm_head(seed: int = 0, near_duplicates: int = 200) -> torch.Tensor:
    """Embedding-like rows, with some rows nearly copying others so their logits nearly tie."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.05
    weight[1:near_duplicates + 1] = weight[0] + torch.randn(near_duplicates, HIDDEN, generator=generator) * 1e-4
    return weight


def hidden_states(rows: int, seed: int = 1, massive: float = 50.0) -> torch.Tensor:
    """Final hidden states with a few dimensions far larger than the rest, as Gemma's are."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=generator) * 3
    x[:, :3] *= massive
    return x


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return lm_head()


@pytest.fixture(scope="module", params=["native", "fbgemm"])
def native(request: pytest.FixtureRequest) -> NativeInt8Matmul | None:
    """The screen's kernel: the C kernel, or None for fbgemm's op."""
    if request.param == "fbgemm":
        if not screening_available():
            pytest.skip("no fbgemm int8 kernel on this CPU")
        return None
    kernel = load_native_matmul(default_cache_dir())
    assert kernel is not None, "the C kernel did not build (is there a C compiler?)"
    return kernel


@pytest.fixture(scope="module")
def screen(weight: torch.Tensor, native: NativeInt8Matmul | None) -> LMHeadScreen:
    built = LMHeadScreen.create(weight, native=native)
    assert built is not None, "the int8 op failed its check against float64"
    assert built.kernel == ("native" if native is not None else "fbgemm")
    return built


def test_every_approximate_logit_is_within_its_bound(screen: LMHeadScreen, weight: torch.Tensor) -> None:
    for massive in (1.0, 50.0, 500.0):
        x = hidden_states(16, seed=int(massive), massive=massive)
        approx, bound = screen.approximate_with_bound(x)
        exact = x.double() @ weight.double().T
        assert ((exact - approx.double()).abs() <= bound.double()).all()
        # Not vacuous: the bound is far below the spread of the logits.
        assert float(bound.median()) < 0.05 * float(exact.std())


@pytest.mark.parametrize("seed", range(4))
def test_greedy_picks_the_argmax_of_the_full_logits(screen: LMHeadScreen, weight: torch.Tensor, seed: int) -> None:
    x = hidden_states(8, seed=seed)
    x[0] = weight[0] * 40        # its best tokens are the near-duplicate rows: near ties
    out = screen.logits(x, [1] * 8, [[]] * 8)
    assert out is not None
    full = x @ weight.T
    assert torch.equal(out.argmax(dim=1), full.argmax(dim=1))
    finite = torch.isfinite(out)
    torch.testing.assert_close(out[finite], full[finite], rtol=0, atol=1e-4)
    assert int(finite[0].sum()) > 100, "row 0's near ties were decided by exact logits"
    assert int(finite.sum(dim=1).max()) < VOCAB // 4, "the screen kept most of the vocabulary"


def test_top_k_rows_get_the_exact_k_best(screen: LMHeadScreen, weight: torch.Tensor) -> None:
    x = hidden_states(6, seed=7)
    counts = [1, 5, 64, 64, 20, 2]
    out = screen.logits(x, counts, [[]] * 6)
    assert out is not None
    full = x @ weight.T
    for row, count in enumerate(counts):
        expected = full[row].topk(count)
        got = out[row].topk(count)
        assert set(got.indices.tolist()) == set(expected.indices.tolist())
        torch.testing.assert_close(got.values, expected.values, rtol=0, atol=1e-4)


def request(params: SamplingParams, prompt: list[int], output: list[int]) -> SampleRequest:
    return SampleRequest(params=params, prompt_token_ids=prompt, output_token_ids=output, num_sampled=len(output))


PARAMS = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(min_tokens=10),
    SamplingParams(temperature=0.8, top_k=40, seed=3),
    SamplingParams(temperature=1.2, top_k=64, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=11),
]


def test_draws_over_screened_rows_equal_draws_over_full_rows(screen: LMHeadScreen, weight: torch.Tensor) -> None:
    assert_draws_match(screen, weight, trials=5)


def assert_draws_match(screen: LMHeadScreen, weight: torch.Tensor, trials: int) -> None:
    """Draws of PARAMS' samplers over screened rows equal their draws over the full rows."""
    sampler = Sampler(seed=0, eos_token_ids=[1])
    x = hidden_states(len(PARAMS), seed=3)
    full = x @ weight.T
    for trial in range(trials):
        # Histories built from each row's own best tokens, so penalties change the winner.
        requests = [request(params, prompt=full[row].topk(3).indices.tolist(),
                            output=full[row].topk(2 + trial).indices.tolist()[1:])
                    for row, params in enumerate(PARAMS)]
        adjusted = [sorted(sampler.adjusted_token_ids(r)) for r in requests]
        counts = [tokens_drawn_from(r.params) for r in requests]
        assert all(count is not None for count in counts)
        out = screen.logits(x, counts, adjusted)
        assert out is not None
        for row, ids in enumerate(adjusted):
            torch.testing.assert_close(out[row, ids], full[row, ids], rtol=1e-5, atol=1e-4)
        got = [t.token_id for t in sampler.sample(out, requests)]
        expected = [t.token_id for t in sampler.sample(full, requests)]
        assert got == expected


def test_adjusted_tokens_cover_what_the_sampler_changes() -> None:
    sampler = Sampler(eos_token_ids=[1, 106])
    plain = request(SamplingParams(), [5, 6], [7])
    assert sampler.adjusted_token_ids(plain) == set()
    repetition = request(SamplingParams(repetition_penalty=1.1), [5, 6], [7])
    assert sampler.adjusted_token_ids(repetition) == {5, 6, 7}
    presence = request(SamplingParams(presence_penalty=0.5), [5, 6], [7, 8])
    assert sampler.adjusted_token_ids(presence) == {7, 8}
    banned = request(SamplingParams(min_tokens=3, stop_token_ids=(42,)), [5], [7])
    assert sampler.adjusted_token_ids(banned) == {1, 106, 42}
    assert sampler.adjusted_token_ids(request(SamplingParams(min_tokens=1), [5], [7])) == set()


def test_rows_that_need_the_whole_distribution_are_not_screened() -> None:
    assert tokens_drawn_from(SamplingParams()) == 1
    assert tokens_drawn_from(SamplingParams(temperature=0.7, top_k=50)) == 50
    assert tokens_drawn_from(SamplingParams(temperature=0.7)) is None
    assert tokens_drawn_from(SamplingParams(temperature=0.7, top_p=0.9)) is None
    assert tokens_drawn_from(SamplingParams(logprobs=True)) is None
    assert tokens_drawn_from(SamplingParams(top_logprobs=3)) is None


def test_softcapped_models_get_capped_values_and_the_same_winner(weight: torch.Tensor,
                                                                native: NativeInt8Matmul | None) -> None:
    capped = LMHeadScreen.create(weight, softcap=30.0, native=native)
    assert capped is not None
    x = hidden_states(4, seed=5)
    out = capped.logits(x, [1, 1, 8, 8], [[]] * 4)
    assert out is not None
    full = torch.tanh((x @ weight.T) / 30.0) * 30.0
    assert torch.equal(out.argmax(dim=1), full.argmax(dim=1))
    finite = torch.isfinite(out)
    torch.testing.assert_close(out[finite], full[finite], rtol=0, atol=1e-4)


def test_non_finite_hidden_states_fall_back_to_the_full_head(screen: LMHeadScreen) -> None:
    x = hidden_states(2)
    x[1, 4] = float("nan")
    assert screen.logits(x, [1, 1], [[], []]) is None


def test_a_zero_hidden_state_keeps_every_tied_token(screen: LMHeadScreen, weight: torch.Tensor) -> None:
    x = torch.zeros(1, HIDDEN)
    out = screen.logits(x, [1], [[]])
    assert out is not None
    assert int(out.argmax()) == int((x @ weight.T).argmax())


def test_the_weight_is_not_copied(weight: torch.Tensor, screen: LMHeadScreen) -> None:
    assert screen.weight.data_ptr() == weight.data_ptr()
    assert screen.vocab_size == VOCAB


@pytest.mark.parametrize("rows", [1, 2, 3, 5, NATIVE_TILE, NATIVE_TILE + 1, 2 * NATIVE_TILE + 3])
@pytest.mark.parametrize("vocab,hidden", [(301, 72), (64, 640), (33, 5)])    # partial panels, odd hidden
def test_the_c_kernel_is_exact_for_every_tile_shape(rows: int, vocab: int, hidden: int) -> None:
    kernel = load_native_matmul(default_cache_dir())
    assert kernel is not None
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randint(-127, 128, (vocab, hidden), generator=generator, dtype=torch.int8)
    w_scale = torch.rand(vocab, generator=generator)
    x = torch.randint(-16383, 16384, (rows, hidden), generator=generator, dtype=torch.int16)
    x_scale = torch.rand(rows, generator=generator)
    out = kernel(kernel.pack(weight, w_scale), x, x_scale)
    sums = x.long() @ weight.long().T                  # exact integers
    # The kernel rounds the sum, then multiplies by each scale in turn, all in float32.
    expected = sums.float() * x_scale[:, None] * w_scale
    assert torch.equal(out, expected)


def test_the_c_kernel_refuses_rows_of_another_width() -> None:
    kernel = load_native_matmul(default_cache_dir())
    assert kernel is not None
    panels = kernel.pack(torch.zeros(4, 16, dtype=torch.int8), torch.ones(4))
    with pytest.raises(ValueError, match="16"):
        kernel(panels, torch.zeros(3, 15, dtype=torch.int16), torch.ones(3))


def test_a_wide_hidden_size_keeps_the_integer_sums_exact() -> None:
    # 127 * hidden * grid must stay below 2^31: wide models get a coarser activation grid.
    screen = LMHeadScreen(torch.randn(16, 5376) * 0.02, native=load_native_matmul(default_cache_dir()))
    assert 127 * 5376 * screen._int16_grid < 2 ** 31
    x = torch.randn(3, 5376)
    approx, bound = screen.approximate_with_bound(x)
    exact = x.double() @ screen.weight.double().T
    assert ((exact - approx.double()).abs() <= bound.double()).all()


def test_the_c_kernels_selections_match_torchs() -> None:
    kernel = load_native_matmul(default_cache_dir())
    assert kernel is not None
    generator = torch.Generator().manual_seed(4)
    values = torch.randn(5, 1000, generator=generator)
    values[2, 10:20] = 7.0                                    # ties at the top
    for k in (1, 3, 64, 1000):
        top = kernel.top_k(values, k)
        expected = values.topk(k, dim=1).values
        torch.testing.assert_close(values.gather(1, top).sort(dim=1, descending=True).values, expected)
        assert all(len(set(row.tolist())) == k for row in top)
    with pytest.raises(ValueError, match="top_k"):
        kernel.top_k(values, 1001)
    floors = torch.tensor([0.5, 2.0, 6.5, -10.0, 9.0])
    rows, cols = kernel.select_above(values, floors, capacity=5000)
    expected_rows, expected_cols = torch.nonzero(values >= floors[:, None], as_tuple=True)
    assert torch.equal(rows, expected_rows) and torch.equal(cols, expected_cols)
    assert kernel.select_above(values, floors, capacity=100) is None     # row 3 alone has 1000


@pytest.mark.parametrize("vocab", [1000, 32 * 40, 70])
def test_the_selections_through_panel_maxima_match_torchs(vocab: int) -> None:
    kernel = load_native_matmul(default_cache_dir())
    assert kernel is not None
    generator = torch.Generator().manual_seed(vocab)
    weight = torch.randint(-127, 128, (vocab, 48), generator=generator, dtype=torch.int8)
    x = torch.randint(-16383, 16384, (5, 48), generator=generator, dtype=torch.int16)
    maxima = torch.empty(5, -(-vocab // 32))
    values = kernel(kernel.pack(weight, torch.rand(vocab, generator=generator)), x, torch.rand(5) + 0.5, maxima)
    padded = torch.nn.functional.pad(values, (0, maxima.shape[1] * 32 - vocab), value=float("-inf"))
    assert torch.equal(maxima, padded.view(5, -1, 32).amax(dim=-1))
    for k in (1, 3, 20, 64, min(vocab, 300)):
        top = kernel.top_k(values, k, maxima)
        expected = values.topk(k, dim=1).values
        assert torch.equal(values.gather(1, top).sort(dim=1, descending=True).values, expected)
        assert all(len(set(row.tolist())) == k for row in top)
    floors = values.quantile(torch.tensor([0.99, 0.5, 0.0, 0.999, 1.0]), dim=1).diagonal() + torch.tensor(
        [0.0, 0.0, -1.0, 0.0, 1.0])
    rows, cols = kernel.select_above(values, floors, 10 * vocab, maxima)
    expected_rows, expected_cols = torch.nonzero(values >= floors[:, None], as_tuple=True)
    assert torch.equal(rows, expected_rows) and torch.equal(cols, expected_cols)
    with pytest.raises(ValueError, match="maxima"):
        kernel.top_k(values, 3, maxima[:, :-1].contiguous())


@pytest.mark.parametrize("count", [0, 5, 1000])
def test_the_c_kernels_gather_dot_matches_torch(count: int) -> None:
    kernel = load_native_matmul(default_cache_dir())
    assert kernel is not None
    generator = torch.Generator().manual_seed(count)
    weight = torch.randn(301, 72, generator=generator)        # 72: past the last 16, a scalar tail
    x = torch.randn(3, 72, generator=generator)
    rows = torch.randint(0, 3, (count,), generator=generator)
    ids = torch.randint(0, 301, (count,), generator=generator)
    expected = (weight.double()[ids] * x.double()[rows]).sum(dim=-1).float()
    torch.testing.assert_close(kernel.gather_dot(weight, x, rows, ids), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rows for"):
        kernel.gather_dot(weight, x, rows[:-1], torch.zeros(count + 1, dtype=torch.long))


def test_a_crowded_first_pass_falls_back_to_torch(weight: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = load_native_matmul(default_cache_dir())
    screen = LMHeadScreen.create(weight, native=kernel)
    assert screen is not None
    monkeypatch.setattr(lm_head_screen, "FIRST_PASS_CAPACITY", 1)
    x = hidden_states(4, seed=8)
    out = screen.logits(x, [1, 1, 5, 5], [[]] * 4)
    assert out is not None
    assert torch.equal(out.argmax(dim=1), (x @ weight.T).argmax(dim=1))
