"""The C elementwise ops (native/elementwise.c) against torch, and gated MLPs swapped for
their fused form only where the activation is exactly one the kernel computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from services.worker.engine.cpu.linear.fused_mlp import FusedGatedMLP, activation_of, fuse_gated_mlps, fused_equivalent
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.kernels.native_ops import NativeElementwise, load_elementwise
from tests.unit.worker.engine_helpers import CONFIGS, Driver, make_engine, prompt_of


@pytest.fixture(scope="module")
def native() -> NativeElementwise:
    ops = load_elementwise(default_cache_dir())
    assert ops is not None, "the C ops did not build (is there a C compiler?)"
    return ops


class GatedMLP(torch.nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(hidden)
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            with torch.no_grad():
                linear.weight.normal_(std=0.3, generator=generator)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("rows,dim", [(1, 8), (3, 13), (8, 640), (512, 640), (4, 1)])
@pytest.mark.parametrize("with_scale", [True, False])
def test_rms_norm_matches_torch(native: NativeElementwise, rows: int, dim: int, with_scale: bool) -> None:
    generator = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=generator) * 20
    scale = torch.randn(dim, generator=generator) if with_scale else None
    torch.testing.assert_close(native.rms_norm(x, scale, 1e-6), F.rms_norm(x, (dim,), scale, 1e-6),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation,reference", [("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
                                                  ("silu", F.silu)])
@pytest.mark.parametrize("rows,dim", [(1, 5), (2, 64), (512, 2048)])
def test_activation_times_up_matches_torch(native: NativeElementwise, activation: str, reference, rows: int,
                                           dim: int) -> None:
    generator = torch.Generator().manual_seed(dim)
    gate = torch.randn(rows, dim, generator=generator) * 6
    up = torch.randn(rows, dim, generator=generator)
    expected = reference(gate.double()) * up.double()
    torch.testing.assert_close(native.act_mul(gate, up, activation).double(), expected, rtol=1e-5, atol=2e-6)
    # Halves of one [rows, 2 * dim] tensor (strided rows) give the same.
    both = torch.cat([gate, up], dim=1)
    torch.testing.assert_close(native.act_mul(both[:, :dim], both[:, dim:], activation),
                               native.act_mul(gate, up, activation), rtol=0, atol=0)
    # Into the gate itself (the fused MLP's wide steps): the same values.
    expected_bits = native.act_mul(gate, up, activation)
    in_place = gate.clone()
    assert native.act_mul(in_place, up, activation, out=in_place).data_ptr() == in_place.data_ptr()
    torch.testing.assert_close(in_place, expected_bits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="contiguous float32"):
        native.act_mul(gate, up, activation, out=torch.empty(rows, dim + 1))


def test_extremes_and_non_finite_inputs(native: NativeElementwise) -> None:
    gate = torch.tensor([[-1e4, -90.0, -20.0, 0.0, 20.0, 90.0, 1e4, float("nan")]])
    up = torch.ones_like(gate)
    gelu = native.act_mul(gate, up, "gelu_tanh")
    assert torch.isnan(gelu[0, -1]) and torch.isfinite(gelu[0, :-1]).all()
    torch.testing.assert_close(gelu[0, :-1], F.gelu(gate[0, :-1], approximate="tanh"), rtol=1e-6, atol=1e-6)
    silu = native.act_mul(gate, up, "silu")
    torch.testing.assert_close(silu[0, :-1], F.silu(gate[0, :-1]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="differ"):
        native.act_mul(gate, up[:, :4], "silu")


def test_activations_are_recognised_only_when_exact() -> None:
    assert activation_of(ACT2FN["gelu_pytorch_tanh"]) == "gelu_tanh"
    assert activation_of(ACT2FN["silu"]) == "silu"
    assert activation_of(ACT2FN["gelu"]) is None          # the erf form
    assert activation_of(ACT2FN["relu"]) is None
    assert activation_of(None) is None


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "silu"])
def test_a_gated_mlp_is_fused_and_agrees(native: NativeElementwise, act: str) -> None:
    mlp = GatedMLP(24, 40, act)
    fused = fused_equivalent(mlp, native)
    assert isinstance(fused, FusedGatedMLP)
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(fused(x), mlp(x), rtol=1e-5, atol=1e-5)


def test_other_mlps_are_left_alone(native: NativeElementwise) -> None:
    model = torch.nn.ModuleDict({"erf": GatedMLP(16, 32, "gelu"), "tanh": GatedMLP(16, 32, "gelu_pytorch_tanh")})
    assert fuse_gated_mlps(model, native) == 1
    assert not isinstance(model["erf"], FusedGatedMLP) and isinstance(model["tanh"], FusedGatedMLP)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_the_engine_gives_the_same_tokens_with_and_without_the_c_kernels(kind: str) -> None:
    prompts = {"a": prompt_of(7, 1), "b": prompt_of(30, 2)}
    fused_engine = make_engine(kind)
    assert fused_engine.fused_mlps == fused_engine.model_config.num_hidden_layers
    # Every attention and MLP projection, the LM head, and (Gemma 4) the per-layer input projections.
    assert fused_engine.native_linears >= 7 * fused_engine.model_config.num_hidden_layers + 1
    plain_engine = make_engine(kind, cpu_native_kernels="off")
    assert plain_engine.fused_mlps == 0 and plain_engine.native_linears == 0
    assert Driver(fused_engine).run(prompts, 10) == Driver(plain_engine).run(prompts, 10)
