"""The LM head screen from the head's 8-bit weight codes (LMHeadScreen.from_codes, the C
kernel fairserve_codes_screen in native/codes_screen.c): the kernel against a float64
reference within its derived rounding bound, on every tile and padding shape and on every
vector path; greedy and top-k over the screened rows pick exactly what they pick over the
full float32 logits; a kernel off its bound fails the check at build; and the loader takes
the codes for 8-bit codes only."""

from __future__ import annotations

import copy
import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu.screen.int8_matmul import CODES_TILE, PANEL, NativeInt8Matmul
from services.worker.engine.cpu.screen.lm_head_screen import LMHeadScreen, load_native_matmul
from services.worker.engine.cpu.kernels.native_build import COMPILE_FLAGS, EXTRA_SOURCES, SOURCES, default_cache_dir
from services.worker.engine.cpu.screen.screen_loader import DEFAULT_SCREEN_MAX_ROWS, ScreenLoader
from services.worker.engine.cpu.linear.weight_codes import CodedWeight, NativeCodedLinear, load_coded_linear
from services.worker.wiring import build_engine
from tests.fixtures.tiny_model import build_model
from tests.unit.worker.engine_helpers import CONFIGS, Driver, assert_greedy_matches, prompt_of
from tests.unit.worker.test_lm_head_screen import assert_draws_match, hidden_states
from tests.unit.worker.test_weight_codes import snap_to_codes

VOCAB, HIDDEN = 6001, 64          # the last panel holds one row
DUPLICATES, NEAR_DUPLICATES = 4, 200
U = 2.0 ** -24


@pytest.fixture(scope="module")
def native() -> NativeInt8Matmul:
    kernel = load_native_matmul(default_cache_dir())
    assert kernel is not None, "the C kernel did not build (is there a C compiler?)"
    return kernel


@pytest.fixture(scope="module")
def coder() -> NativeCodedLinear:
    kernel = load_coded_linear(default_cache_dir())
    assert kernel is not None, "the coded linear did not build (is there a C compiler?)"
    return kernel


def q8_head(coder: NativeCodedLinear, vocab: int = VOCAB, hidden: int = HIDDEN, group: int = 32,
            seed: int = 0) -> tuple[torch.Tensor, CodedWeight]:
    """A Q8_0-like head, scale * (code - 128) in every block (scales of 11 significant bits, so
    the float32 values are exact), and its 8-bit codes. Rows 1..DUPLICATES copy row 0 and the
    next NEAR_DUPLICATES are row 0 with one code a step off: ties and near ties."""
    generator = torch.Generator().manual_seed(seed)
    blocks = hidden // group
    scales = torch.randint(1024, 2048, (vocab, blocks, 1), generator=generator).float() * 2.0 ** -18
    codes = torch.randint(0, 256, (vocab, blocks, group), generator=generator)
    copies = slice(1, 1 + DUPLICATES + NEAR_DUPLICATES)
    codes[copies], scales[copies] = codes[0], scales[0]
    flat = codes.view(vocab, hidden)
    near = torch.arange(1 + DUPLICATES, 1 + DUPLICATES + NEAR_DUPLICATES)
    columns = torch.randint(0, hidden, (NEAR_DUPLICATES,), generator=generator)
    flat[near, columns] = torch.where(flat[near, columns] < 255, flat[near, columns] + 1, flat[near, columns] - 1)
    weight = (scales * (codes.float() - 128)).reshape(vocab, hidden)
    coded = coder.find(weight)
    assert coded is not None and coded.bits == 8 and coded.group == group
    return weight, coded


def narrow_codes(coder: NativeCodedLinear, vocab: int, hidden: int) -> CodedWeight:
    """4-bit codes (narrow, weight_codes.py) of a weight of 16 levels a block."""
    narrow = coder.narrow(coder.find(narrow_weight(vocab, hidden)))
    assert narrow.bits == 4
    return narrow


def narrow_weight(vocab: int, hidden: int) -> torch.Tensor:
    return (torch.arange(vocab * hidden) % 16).float().view(vocab, hidden) * 0.25


@pytest.fixture(scope="module")
def head(coder: NativeCodedLinear) -> tuple[torch.Tensor, CodedWeight]:
    return q8_head(coder)


@pytest.fixture(scope="module")
def screen(head: tuple[torch.Tensor, CodedWeight], native: NativeInt8Matmul) -> LMHeadScreen:
    built = LMHeadScreen.from_codes(head[1], None, native)
    assert built is not None, "the codes kernel failed its check against float64"
    assert built.kernel == "codes" and built.weight is None and built._panels is None    # no int8 copy
    return built


def expanded(coded: CodedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float32 rows the codes stand for, alpha = code * |scale| + |offset|), float64 [V, in]."""
    ids = torch.arange(coded.out_features)
    panel, lane = ids // PANEL, ids % PANEL
    codes = coded.codes[panel, :, lane].double().view(len(ids), -1, coded.group)
    scales, offsets = coded.scales[panel, :, lane].double(), coded.offsets[panel, :, lane].double()
    alpha = codes * scales.abs()[..., None] + offsets.abs()[..., None]
    return coded.rows(ids).double(), alpha.view(len(ids), -1)


def within_kernel_bound(coded: CodedWeight, x: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor) -> bool:
    """|out - (x * x_scale) @ w.T| <= (2B + 4) u (1 + 1e-3) x_scale sum_i alpha_i |x_i| entrywise:
    the kernel's rounding bound before Cauchy-Schwarz (codes_screen_bound.codes_error_norms)."""
    weights, alpha = expanded(coded)
    scaled = x.double() * x_scale.double()[:, None]
    blocks = coded.in_features // coded.group
    allowed = (2 * blocks + 4) * U * 1.001 * (scaled.abs() @ alpha.T)
    return bool(((out.double() - scaled @ weights.T).abs() <= allowed).all())


def random_codes(vocab: int, in_features: int, group: int, seed: int) -> CodedWeight:
    """Codes, scales and offsets at random (zero past the vocabulary, as `find` pads them)."""
    generator = torch.Generator().manual_seed(seed)
    panels = -(-vocab // PANEL)
    codes = torch.randint(0, 256, (panels, in_features, PANEL), generator=generator, dtype=torch.uint8)
    scales = torch.randn(panels, in_features // group, PANEL, generator=generator)
    offsets = torch.randn(panels, in_features // group, PANEL, generator=generator) * 100
    pad = slice(vocab - (panels - 1) * PANEL, PANEL)
    codes[-1, :, pad], scales[-1, :, pad], offsets[-1, :, pad] = 0, 0.0, 0.0
    return CodedWeight(codes, scales, offsets, group, vocab, in_features)


def extreme_rows(rows: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-32768, 32768, (rows, in_features), generator=generator, dtype=torch.int16)
    x[0] = 32767
    if rows > 1:
        x[1] = -32768
    return x, torch.rand(rows, generator=generator) + 0.5


# ---- the kernel ---------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 2, 3, 5, CODES_TILE, CODES_TILE + 1, 2 * CODES_TILE + 3, 30])
@pytest.mark.parametrize("vocab,in_features,group", [(301, 64, 32), (64, 640, 32), (33, 48, 16), (70, 32, 16)])
def test_the_codes_kernel_is_within_its_rounding_bound(native: NativeInt8Matmul, rows: int, vocab: int,
                                                       in_features: int, group: int) -> None:
    coded = random_codes(vocab, in_features, group, seed=rows + vocab)
    x, x_scale = extreme_rows(rows, in_features, seed=rows)
    maxima = torch.empty(rows, -(-vocab // PANEL))
    out = native.codes_screen(coded, x, x_scale, maxima)
    assert out.shape == (rows, vocab)
    assert within_kernel_bound(coded, x, x_scale, out)
    padded = torch.nn.functional.pad(out, (0, maxima.shape[1] * PANEL - vocab), value=float("-inf"))
    assert torch.equal(maxima, padded.view(rows, -1, PANEL).amax(dim=-1))


def test_the_codes_kernel_writes_nothing_past_the_vocabulary(native: NativeInt8Matmul) -> None:
    coded = random_codes(40, 32, 32, seed=3)
    x, x_scale = extreme_rows(3, 32, seed=3)
    # Rows of a wider buffer: each row's outputs must end at the vocabulary, not at its panel.
    out = native.codes_screen(CodedWeight(coded.codes, coded.scales, coded.offsets, 32, 33, 32), x, x_scale)
    full = native.codes_screen(coded, x, x_scale)
    assert torch.equal(out, full[:, :33])


def test_the_codes_kernel_refuses_what_it_does_not_take(native: NativeInt8Matmul, coder: NativeCodedLinear) -> None:
    coded = random_codes(64, 64, 32, seed=1)
    with pytest.raises(ValueError, match="32 entries"):
        native.codes_screen(coded, torch.zeros(2, 32, dtype=torch.int16), torch.ones(2))
    with pytest.raises(ValueError, match="int16"):
        native.codes_screen(coded, torch.zeros(2, 64), torch.ones(2))
    narrow = narrow_codes(coder, 64, 64)
    with pytest.raises(ValueError, match="4-bit"):
        native.codes_screen(narrow, torch.zeros(2, 64, dtype=torch.int16), torch.ones(2))


def _build(flags: list[str], target: Path) -> NativeInt8Matmul:
    """native/int8_matmul.c (with its further sources) built for another instruction set than this CPU's best."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    command = [compiler, *[f for f in COMPILE_FLAGS if f != "-march=native"], *flags, "-o", str(target),
               str(SOURCES / "int8_matmul.c"), *(str(SOURCES / extra) for extra in EXTRA_SOURCES["int8_matmul"]),
               "-lm"]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return NativeInt8Matmul(ctypes.CDLL(str(target)))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            return next((set(line.split(":")[1].split()) for line in cpuinfo if line.startswith("flags")), set())
    except OSError:
        return set()


# Instruction sets below this CPU's best, each with the CPU flags its code needs to run here.
PATHS = {"-march=skylake-avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"},
         "-march=x86-64-v3": {"avx2", "fma", "bmi2", "f16c", "movbe"},
         "-march=x86-64": set()}


@pytest.mark.skipif(platform.machine() != "x86_64" or not (shutil.which("cc") or shutil.which("gcc")),
                    reason="the other vector paths are built for x86-64")
def test_every_vector_path_gives_the_same_outputs(native: NativeInt8Matmul, tmp_path: Path) -> None:
    """AVX-512 without VNNI, AVX2 and plain C make the same operations in the same order."""
    coded = random_codes(301, 96, 16, seed=5)
    x, x_scale = extreme_rows(2 * CODES_TILE + 3, 96, seed=5)
    expected = native.codes_screen(coded, x, x_scale)
    flags = _cpu_flags()
    runnable = [march for march, needs in PATHS.items() if needs <= flags]
    assert "-march=x86-64" in runnable
    for number, march in enumerate(runnable):
        kernel = _build([march], tmp_path / f"int8_matmul_{number}.so")
        assert torch.equal(kernel.codes_screen(coded, x, x_scale), expected), march


# ---- the screen ---------------------------------------------------------------------------

def test_every_approximate_logit_is_within_its_bound(screen: LMHeadScreen,
                                                     head: tuple[torch.Tensor, CodedWeight],
                                                     native: NativeInt8Matmul) -> None:
    weight = head[0]
    copy_screen = LMHeadScreen.create(weight, native=native)
    assert copy_screen is not None and copy_screen.kernel == "native"
    for massive in (1.0, 50.0, 500.0):
        x = hidden_states(16, seed=int(massive), massive=massive)
        approx, bound = screen.approximate_with_bound(x)
        exact = x.double() @ weight.double().T
        assert ((exact - approx.double()).abs() <= bound.double()).all()
        # Not vacuous, and tighter than the int8 copy's: the weight side is exact now.
        assert float(bound.median()) < 0.01 * float(exact.std())
        assert float(bound.median()) < 0.5 * float(copy_screen.approximate_with_bound(x)[1].median())


@pytest.mark.parametrize("seed", range(4))
def test_greedy_picks_the_argmax_of_the_full_logits(screen: LMHeadScreen, head: tuple[torch.Tensor, CodedWeight],
                                                    seed: int) -> None:
    weight = head[0]
    x = hidden_states(2 * CODES_TILE + 1, seed=seed)
    x[0] = weight[0] * 40                       # its best tokens are row 0's copies: ties and near ties
    x[1] = weight[DUPLICATES + 7] * 40
    out = screen.logits(x, [1] * len(x), [[]] * len(x))
    assert out is not None
    full = x @ weight.T
    assert torch.equal(out.argmax(dim=1), full.argmax(dim=1))
    finite = torch.isfinite(out)
    torch.testing.assert_close(out[finite], full[finite], rtol=1e-5, atol=1e-4)
    for row in (0, 1):
        best = full[row] == full[row].max()
        assert int(best.sum()) > 1 and bool(finite[row][best].all()), "every tie got its exact logit"
    assert int(finite.sum(dim=1).max()) < VOCAB // 20, "the screen kept much of the vocabulary"


def test_top_k_rows_get_the_exact_k_best(screen: LMHeadScreen, head: tuple[torch.Tensor, CodedWeight]) -> None:
    weight = head[0]
    x = hidden_states(9, seed=7, massive=80.0)
    counts = [1, 5, 64, 64, 20, 2, 40, 64, 3]
    out = screen.logits(x, counts, [[]] * len(x))
    assert out is not None
    full = x @ weight.T
    for row, count in enumerate(counts):
        expected = full[row].topk(count)
        got = out[row].topk(count)
        assert set(got.indices.tolist()) == set(expected.indices.tolist())
        torch.testing.assert_close(got.values, expected.values, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("adjusted", [[], [3, 70]], ids=["C pick", "adjusted tokens"])
def test_a_call_reuses_the_last_calls_rows_and_carries_nothing_over(head: tuple[torch.Tensor, CodedWeight],
                                                                    native: NativeInt8Matmul,
                                                                    adjusted: list[int]) -> None:
    """The screen's logits rows (and its approximate ones) are kept from call to call, not
    allocated afresh; a call of fewer rows gets the same rows as a screen of its own."""
    screen = LMHeadScreen.from_codes(head[1], None, native, "int16")
    assert screen is not None
    first = screen.logits(hidden_states(9, seed=11), [1] * 9, [adjusted] * 9)
    assert first is not None
    storage = first.data_ptr()
    x = hidden_states(3, seed=12)
    again = screen.logits(x, [2] * 3, [adjusted] * 3)
    assert again is not None and again.data_ptr() == storage
    fresh = LMHeadScreen.from_codes(head[1], None, native, "int16")
    assert fresh is not None
    expected = fresh.logits(x, [2] * 3, [adjusted] * 3)
    assert expected is not None and torch.equal(again, expected)


def test_draws_over_screened_rows_equal_draws_over_full_rows(screen: LMHeadScreen,
                                                             head: tuple[torch.Tensor, CodedWeight]) -> None:
    assert_draws_match(screen, head[0], trials=3)


def test_softcapped_models_get_capped_values_and_the_same_winner(head: tuple[torch.Tensor, CodedWeight],
                                                                native: NativeInt8Matmul) -> None:
    weight, coded = head
    capped = LMHeadScreen.from_codes(coded, 30.0, native)
    assert capped is not None
    x = hidden_states(4, seed=5) / 20          # logits within the cap's range (no float32 ties at 30)
    out = capped.logits(x, [1, 1, 8, 8], [[]] * 4)
    assert out is not None
    full = torch.tanh((x @ weight.T) / 30.0) * 30.0
    assert torch.equal(out.argmax(dim=1), full.argmax(dim=1))
    finite = torch.isfinite(out)
    torch.testing.assert_close(out[finite], full[finite], rtol=1e-5, atol=1e-4)


def test_groups_of_16_and_a_wide_hidden_size(coder: NativeCodedLinear, native: NativeInt8Matmul) -> None:
    weight, coded = q8_head(coder, vocab=1000, hidden=1536, group=16, seed=2)
    screen = LMHeadScreen.from_codes(coded, None, native)
    assert screen is not None
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(5, 1536, generator=generator)
    x[:, 7:10] *= 60
    approx, bound = screen.approximate_with_bound(x)
    exact = x.double() @ weight.double().T
    assert ((exact - approx.double()).abs() <= bound.double()).all()
    out = screen.logits(x, [1, 1, 64, 3, 1], [[]] * 5)
    assert out is not None
    assert torch.equal(out.argmax(dim=1), (x @ weight.T).argmax(dim=1))


def test_the_check_rejects_a_kernel_off_its_bound(head: tuple[torch.Tensor, CodedWeight],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = load_native_matmul(default_cache_dir())       # an instance of its own to break
    assert kernel is not None
    coded = head[1]
    assert LMHeadScreen.from_codes(coded, None, kernel) is not None
    original = kernel.codes_screen

    def off(*args, **kwargs) -> torch.Tensor:
        out = original(*args, **kwargs)
        if out.shape[0] > CODES_TILE + 1:       # the check's rows, not the one-row timing
            out[CODES_TILE + 1, 100] += float(out.abs().max()) * 1e-3     # one output, in the second tile
        return out

    monkeypatch.setattr(kernel, "codes_screen", off)
    assert LMHeadScreen.from_codes(coded, None, kernel) is None

    def wrong_maxima(coded: CodedWeight, x: torch.Tensor, x_scale: torch.Tensor,
                     maxima: torch.Tensor | None = None, *half: object) -> torch.Tensor:
        out = original(coded, x, x_scale, maxima, *half)
        if maxima is not None:
            maxima[2, -1] -= 1.0
        return out

    monkeypatch.setattr(kernel, "codes_screen", wrong_maxima)
    assert LMHeadScreen.from_codes(coded, None, kernel) is None


# ---- the loader -----------------------------------------------------------------------------

def loaded(weight: torch.Tensor, coded: CodedWeight | None, native_kernels: bool = True,
           weights: str = "auto", activations: str = "int16") -> ScreenLoader:
    config = EngineConfig(model_dir="", lm_head_screen="on", lm_head_screen_weights=weights,
                          lm_head_screen_activations=activations)
    loader = ScreenLoader(config, None, default_cache_dir(), native_kernels)
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = None                           # as a head served from its codes holds no weight
    loader.start(head, torch.device("cpu"), torch.float32, weight, coded)
    assert loader.wait(timeout=0)
    return loader


def test_the_loader_screens_8_bit_codes_from_the_codes(head: tuple[torch.Tensor, CodedWeight]) -> None:
    weight, coded = head
    loader = loaded(weight, coded)
    assert loader.screen is not None and loader.screen.kernel == "codes"
    assert loader.screen.weight is None and loader.screen._panels is None
    assert loader.max_rows(loader.screen) == DEFAULT_SCREEN_MAX_ROWS["codes"]
    x = hidden_states(3, seed=4)
    assert torch.equal(loader.screen.logits(x, [1] * 3, [[]] * 3).argmax(dim=1), (x @ weight.T).argmax(dim=1))


def test_the_loader_keeps_the_int8_copy_otherwise(coder: NativeCodedLinear, head: tuple[torch.Tensor, CodedWeight],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    weight, coded = head
    without_codes = loaded(weight, None).screen
    assert without_codes is not None and without_codes.kernel == "native"
    assert without_codes.weight.data_ptr() == weight.data_ptr()
    from_narrow = loaded(narrow_weight(VOCAB, HIDDEN), narrow_codes(coder, VOCAB, HIDDEN)).screen
    assert from_narrow is not None and from_narrow.kernel == "native" and from_narrow.weight is None
    # A codes kernel that fails its check: the int8 copy serves (its own kernel checked apart).
    monkeypatch.setattr(NativeInt8Matmul, "codes_screen",
                        lambda self, coded, x, *args, **kwargs: torch.zeros(len(x), coded.out_features))
    fallback = loaded(weight, coded).screen
    assert fallback is not None and fallback.kernel == "native" and fallback.weight is None


def test_lm_head_screen_weights_copy_keeps_an_int8_copy_of_a_coded_head(head: tuple[torch.Tensor,
                                                                                    CodedWeight]) -> None:
    weight, coded = head
    screen = loaded(weight, coded, weights="copy").screen
    assert screen is not None and screen.kernel == "native" and screen._panels is not None
    x = hidden_states(3, seed=5)
    assert torch.equal(screen.logits(x, [1] * 3, [[]] * 3).argmax(dim=1), (x @ weight.T).argmax(dim=1))
    with pytest.raises(ValueError, match="LM_HEAD_SCREEN_WEIGHTS"):
        loaded(weight, coded, weights="int4")


def test_an_engine_with_an_8_bit_coded_head_screens_from_the_codes() -> None:
    reference = build_model(CONFIGS["gemma3"]())
    snap_to_codes(reference, levels=256)
    engine = build_engine(EngineConfig(model_dir="", num_blocks=128, block_size=4, model_key="coded",
                                       lm_head_screen="on", cpu_weight_codes="8bit"), model=copy.deepcopy(reference))
    screen = engine.prepared.screen.screen
    assert screen is not None and screen.kernel == "codes"
    prompts = {"a": prompt_of(7, 1), "b": prompt_of(30, 2), "c": prompt_of(3, 3)}
    driver = Driver(engine)
    got = driver.run(prompts, 12, chunk={"b": 9})
    assert_greedy_matches(reference, prompts, got, 12)
    assert sum(step.screened_rows for step in driver.steps) > 0
