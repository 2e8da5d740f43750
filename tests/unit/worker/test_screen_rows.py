"""Two screens of one head, each serving the step widths it was timed faster on (screen_rows.py)."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.cpu.screen import screen_rows
from services.worker.engine.cpu.screen.codes_screen_int8 import int8_available
from services.worker.engine.cpu.screen.int8_matmul import NativeInt8Matmul
from services.worker.engine.cpu.screen.lm_head_screen import LMHeadScreen
from services.worker.engine.cpu.screen.screen_rows import RowSplit, few_rows_limit, split_by_rows
from services.worker.engine.cpu.linear.weight_codes import CodedWeight
from tests.unit.worker.test_lm_head_codes_screen import coder, head, loaded, native  # noqa: F401
from tests.unit.worker.test_lm_head_screen import hidden_states


class FakeClock:
    """Time that passes only inside a fake screen's `logits`, by its cost at that many rows, in
    whole microseconds (equal costs compare equal)."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


class FakeCoded:
    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ones(ids.numel(), 4)


class FakeScreen:
    vocab_size = 100
    _coded = FakeCoded()

    def __init__(self, clock: FakeClock, activations: str, ms_per_call: dict[int, float]) -> None:
        self.clock, self.activations, self.ms = clock, activations, ms_per_call
        self.calls: list[int] = []
        self.shared_with: FakeScreen | None = None
        self.released = False

    def share_rows(self, other: FakeScreen) -> None:
        self.shared_with = other

    def release_rows(self) -> None:
        self.released = True

    def logits(self, hidden: torch.Tensor, counts: list[int], adjusted: list[list[int]]) -> torch.Tensor:
        rows = hidden.shape[0]
        assert counts == [1] * rows and adjusted == [[]] * rows     # greedy rows, as decode steps sample
        self.calls.append(rows)
        self.clock.now += round(self.ms[rows] * 1000)
        return torch.zeros(rows, self.vocab_size)


def screens(int16_ms: dict[int, float], int8_ms: dict[int, float]) -> tuple[FakeScreen, FakeScreen, FakeClock]:
    clock = FakeClock()
    return FakeScreen(clock, "int16", int16_ms), FakeScreen(clock, "int8", int8_ms), clock


COUNTS = screen_rows.ROW_COUNTS


def test_the_few_rows_screen_serves_up_to_the_last_width_it_was_faster_at_throughout() -> None:
    few, many, clock = screens({1: 3, 2: 3, 4: 4, 8: 5, 16: 9, 32: 16}, {1: 4, 2: 4, 4: 5, 8: 6, 16: 8, 32: 11})
    assert few_rows_limit(few, many, clock) == 8
    assert sorted(set(few.calls)) == [1, 2, 4, 8, 16] and few.calls.count(1) == screen_rows.ROUNDS
    # Faster again at 32 after losing at 16: the split stays at 8 (a prefix, not scattered widths).
    few, many, clock = screens({1: 3, 2: 3, 4: 4, 8: 5, 16: 9, 32: 10}, {1: 4, 2: 4, 4: 5, 8: 6, 16: 8, 32: 11})
    assert few_rows_limit(few, many, clock) == 8


def test_no_split_where_the_int16_screen_is_not_faster_on_the_narrowest_step() -> None:
    few, many, clock = screens(dict.fromkeys(COUNTS, 5.0), dict.fromkeys(COUNTS, 5.0))
    assert few_rows_limit(few, many, clock) == 0
    assert split_by_rows(many, lambda: few, clock) is None


def test_a_split_only_beside_an_int8_screen() -> None:
    few, many, clock = screens(dict.fromkeys(COUNTS, 1.0), dict.fromkeys(COUNTS, 2.0))
    split = split_by_rows(many, lambda: few, clock)
    assert split is not None and split.few_rows == max(COUNTS)
    assert few.shared_with is many and many.released       # one set of rows, let go after the timing
    assert split.screen_for(1) is few and split.screen_for(max(COUNTS)) is few and split.screen_for(33) is many
    int16, other, _ = screens(dict.fromkeys(COUNTS, 1.0), dict.fromkeys(COUNTS, 2.0))
    built: list[str] = []
    assert split_by_rows(int16, lambda: built.append("few") or other, clock) is None     # many rounds int16
    assert built == []
    assert split_by_rows(many, lambda: None, clock) is None                              # no int16 screen


def test_a_split_of_real_screens_gives_the_full_heads_tokens_either_side(head: tuple[torch.Tensor, CodedWeight],  # noqa: F811
                                                                         native: NativeInt8Matmul,  # noqa: F811
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    weight, coded = head
    if not int8_available(native, coded):
        pytest.skip("the int8 codes kernel needs AVX-512 VNNI and VBMI")
    many = LMHeadScreen.from_codes(coded, None, native, "int8")
    assert many is not None and many.activations == "int8"
    clock = FakeClock()
    original = LMHeadScreen.logits

    def timed(screen: LMHeadScreen, *args: object) -> torch.Tensor | None:     # int16 is faster up to 4 rows
        clock.now += 1 if (screen.activations == "int16") == (args[0].shape[0] <= 4) else 2
        return original(screen, *args)

    monkeypatch.setattr(LMHeadScreen, "logits", timed)
    split = split_by_rows(many, lambda: LMHeadScreen.from_codes(coded, None, native, "int16"), clock)
    assert isinstance(split, RowSplit) and split.few_rows == 4 and split.few.activations == "int16"
    storage = set()
    for rows in (9, 5, 4, 1):          # widest first: the rows grow only once
        x = hidden_states(rows, seed=rows)
        out = split.screen_for(rows).logits(x, [1] * rows, [[]] * rows)
        assert out is not None and torch.equal(out.argmax(dim=1), (x @ weight.T).argmax(dim=1))
        storage.add(out.data_ptr())
    assert len(storage) == 1, "both screens write one set of logits rows"


def test_the_loader_hands_each_step_the_screen_for_its_rows(head: tuple[torch.Tensor, CodedWeight]) -> None:  # noqa: F811
    weight, coded = head
    loader = loaded(weight, coded)
    assert loader.screen is not None and loader.screen_for(1) is loader.screen    # int16 alone: no split
    few, many, _ = screens({}, {})
    loader._split = RowSplit(few, many, 8)
    assert loader.screen_for(8) is few and loader.screen_for(9) is many
