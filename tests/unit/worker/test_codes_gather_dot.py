"""The screen's exact logits straight from a head's 8-bit codes (fairserve_codes_gather_dot in
native/int8_matmul.c): the same bits as expanding the rows first (CodedWeight.rows) and taking
fairserve_gather_dot over them, on codes whose products round (no fused multiply-add may
change them), on one pair and on enough to run on every thread, and its refusals."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.cpu.screen.int8_matmul import NativeInt8Matmul
from services.worker.engine.cpu.linear.weight_codes import NativeCodedLinear
from tests.unit.worker.test_lm_head_codes_screen import coder, narrow_codes, native, random_codes  # noqa: F401


@pytest.mark.parametrize("count", [1, 7, 300])
@pytest.mark.parametrize("vocab,in_features,group", [(301, 64, 32), (70, 40, 8), (33, 640, 32)])
def test_it_gives_the_bits_of_gathering_the_rows_first(native: NativeInt8Matmul, count: int, vocab: int,
                                                       in_features: int, group: int) -> None:
    coded = random_codes(vocab, in_features, group, seed=count + vocab)     # float scales: products round
    generator = torch.Generator().manual_seed(count)
    x = torch.randn(5, in_features, generator=generator) * 3
    rows = torch.randint(0, 5, (count,), generator=generator)
    ids = torch.randint(0, vocab, (count,), generator=generator)
    ids[0] = vocab - 1
    gathered = coded.rows(ids)
    expected = native.gather_dot(gathered, x, rows, torch.arange(count))
    assert torch.equal(native.codes_gather_dot(coded, x, rows, ids), expected)


def test_it_refuses_what_it_does_not_take(native: NativeInt8Matmul, coder: NativeCodedLinear) -> None:
    coded = random_codes(64, 64, 32, seed=1)
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="rows of 32"):
        native.codes_gather_dot(coded, torch.zeros(2, 32), torch.zeros(2), ids)
    with pytest.raises(ValueError, match="float64"):
        native.codes_gather_dot(coded, torch.zeros(2, 64, dtype=torch.float64), torch.zeros(2), ids)
    with pytest.raises(ValueError, match="3 rows for 2 ids"):
        native.codes_gather_dot(coded, torch.zeros(2, 64), torch.zeros(3), ids)
    with pytest.raises(ValueError, match="4-bit"):
        native.codes_gather_dot(narrow_codes(coder, 64, 64), torch.zeros(2, 64), torch.zeros(2), ids)
