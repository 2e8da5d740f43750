"""Codes read together (coded_groups.py): a layer's q, k, v (or gate, up) codes joined into one
weight whose panels are theirs in order, each linear's own codes a view of it, and left apart
wherever one call could not read them as one weight. (That the C layers' outputs stay the same
bits is test_native_layers.py's and test_lora_native_layers.py's.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from services.worker.engine.cpu.linear.coded_groups import read_together
from services.worker.engine.cpu.linear.weight_codes import PANEL, CodedWeight


@dataclass
class Linear:
    coded: CodedWeight | None


def _coded(out_features: int, in_features: int = 64, group: int = 32, bits: int = 8, seed: int = 0) -> CodedWeight:
    generator = torch.Generator().manual_seed(seed)
    panels = -(-out_features // PANEL)
    codes = torch.randint(0, 256, (panels, in_features, PANEL), generator=generator, dtype=torch.uint8)
    scales = torch.rand(panels, in_features // group, PANEL, generator=generator)
    return CodedWeight(codes, scales, -scales * 3, group, out_features, in_features, bits)


def test_three_weights_become_views_of_one_in_order() -> None:
    linears = [Linear(_coded(out, seed=seed)) for seed, out in enumerate((64, 32, 32))]
    before = [linear.coded for linear in linears]
    joined = read_together(linears)
    assert joined is not None and joined.out_features == 128 and joined.codes.shape == (4, 64, PANEL)
    start = 0
    for linear, weight in zip(linears, before):
        view = linear.coded
        assert view.out_features == weight.out_features and view.group == weight.group
        for name in ("codes", "scales", "offsets"):
            mine, theirs = getattr(view, name), getattr(weight, name)
            assert torch.equal(mine, theirs)
            assert mine.untyped_storage().data_ptr() == getattr(joined, name).untyped_storage().data_ptr()
            assert mine.data_ptr() == getattr(joined, name)[start // PANEL].data_ptr()
        ids = torch.arange(weight.out_features)
        assert torch.equal(view.rows(ids), weight.rows(ids))
        start += weight.out_features


@pytest.mark.parametrize("second", [
    dict(out_features=16),                   # a part panel: the next weight would not start on a panel
    dict(out_features=32, bits=5),
    dict(out_features=32, group=16),
    dict(out_features=32, in_features=96),
], ids=["part-panel", "bits", "group", "inputs"])
def test_weights_one_call_cannot_read_as_one_stay_apart(second: dict) -> None:
    linears = [Linear(_coded(64)), Linear(_coded(**second))]
    before = [linear.coded for linear in linears]
    assert read_together(linears) is None
    assert [linear.coded for linear in linears] == before


def test_a_single_weight_or_one_without_codes_is_left_alone() -> None:
    alone = Linear(_coded(64))
    assert read_together([alone]) is None
    linears = [Linear(_coded(64)), Linear(None)]
    assert read_together(linears) is None and linears[1].coded is None
