"""Timers around the engine's parts, for the step profile (clock.py): installed on
one engine instance by wrapping its objects' callables, so the engine's code is
run unchanged and nothing outside this benchmark is patched for good.

Categories (each call's exclusive time):

* layer GEMMs: every linear of the decoder layers (q, k, v, o, gate, up, down),
  with their floating-point operations (2 x rows x in x out);
* attention: the paged attention function (prefill chunks and decodes);
* norms: every RMSNorm (per layer, q/k, the final one);
* RoPE: the rotary embedding of each layer's queries and keys;
* MLP activation: the gated MLP less its linears (the activation and product);
* embedding + rotary tables: the token lookup and the step's cos/sin tables;
* layers in one C call: the whole layer stack of a decode-only step, or of a step
  of at most 32 prefill rows, when the C layers take the step (its GEMMs, attention
  and norms are inside; the profile's second pass runs decode-only steps through the
  Python path to split it);
* forward glue: the rest of the forward (residual adds, views, Python between
  the calls above, the sampled rows' gather);
* LM head + screen: the logits of the sampled rows (the screen's rows and any
  full rows), with the screen's integer pass over the whole vocabulary (int8 or
  int16 activations), its top-k of the approximate logits and its exact logits of
  the candidates apart, or where its C path takes the rows (native/screen_pick.c) the
  pass and, as "pick", the rounding, top-k, bounds and exact logits around it;
  sampler: the token choice from them; sampling glue: the rest;
* step inputs: the packed ids, positions, slots and attention metadata;
* planning, commit, and engine Python: the step's planning, the sampled tokens'
  commit, and the rest of `Engine.step` (isolation, result building, pool stats).
"""

from __future__ import annotations

import torch

from benchmarks.step_profile.clock import StepClock
from services.worker.engine.engine import Engine
from common.step import StepBatch
from services.worker.engine.step import forward as forward_module
from services.worker.engine.cpu import direct_forward as direct_module

GEMMS = "layer GEMMs"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm")


def classify(batch: StepBatch) -> tuple[str, int]:
    """A step's kind ("prefill" when any work item computes more than one token) and rows."""
    rows = sum(item.num_tokens + item.draft_tokens for item in batch.work)
    return ("prefill" if any(item.num_tokens > 1 for item in batch.work) else "decode"), rows


def _linear_flops(module: torch.nn.Module):
    out_features = module.out_features

    def flops(x: torch.Tensor) -> float:
        return 2.0 * x.numel() * out_features

    return flops


def _wrap_forward(clock: StepClock, module: torch.nn.Module, category: str, flops=None) -> None:
    module.forward = clock.timed(category, module.forward, flops)


def _instrument_layers(clock: StepClock, base: torch.nn.Module) -> list[tuple[int, int]]:
    """Timers on every layer's linears, norms and MLP; the (in, out) shapes of one layer's linears."""
    shapes = []
    for index, layer in enumerate(base.layers[:base.config.num_hidden_layers]):
        attn, mlp = layer.self_attn, layer.mlp
        linears = [getattr(attn, name) for name in PROJECTIONS] + [getattr(mlp, name) for name in MLP_PROJECTIONS]
        for linear in linears:
            _wrap_forward(clock, linear, GEMMS, _linear_flops(linear))
            if index == 0:
                shapes.append((linear.in_features, linear.out_features))
        for holder, name in [(layer, n) for n in NORMS] + [(attn, "q_norm"), (attn, "k_norm")]:
            norm = getattr(holder, name, None)
            if norm is not None:
                _wrap_forward(clock, norm, "norms")
        _wrap_forward(clock, mlp, "MLP activation")
    _wrap_forward(clock, base.norm, "norms")
    _wrap_forward(clock, base.embed_tokens, "embedding + rotary tables")
    _wrap_forward(clock, base.rotary_emb, "embedding + rotary tables")
    return shapes


class _TimedLayers:
    """The C decode layers behind a timer (an instance's __call__ cannot be wrapped in place)."""

    def __init__(self, clock: StepClock, layers) -> None:
        self._layers = layers
        self.takes = layers.takes
        self._call = clock.timed("layers in one C call", layers.__call__)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)


def _instrument_direct(clock: StepClock, direct, base: torch.nn.Module) -> None:
    layers = list(base.layers[:base.config.num_hidden_layers])
    shape = direct._shape
    direct._steps = [direct_module._LayerSteps.of(layer, shape) for layer in layers]   # the wrapped forwards
    if direct._native is not None:
        direct._native.rope = clock.timed("RoPE", direct._native.rope)
    direct._rope = clock.timed("RoPE", direct._rope)
    if direct.native_layers is not None:
        direct.native_layers = _TimedLayers(clock, direct.native_layers)


def _instrument_screen(clock: StepClock, engine: Engine) -> None:
    """The LM head screen's parts (cpu/lm_head_screen.py), when it is built."""
    screen = engine.prepared.screen.screen
    if screen is None:
        return
    screen._approximate = clock.timed("screen: integer pass", screen._approximate)
    screen._exact = clock.timed("screen: exact logits", screen._exact)
    if screen._native is not None:
        native = screen._native
        native.top_k = clock.timed("screen: top-k", native.top_k)
        # The C path around the kernel (native/screen_pick.c): the pass itself, then the pick.
        native.codes_screen = clock.timed("screen: integer pass", native.codes_screen)
        native.screen_quantize = clock.timed("screen: pick (C)", native.screen_quantize)
        native.screen_pick = clock.timed("screen: pick (C)", native.screen_pick)


def use_c_layers(engine: Engine, layers):
    """Sets the direct forward's C decode layers (None: decode-only steps take the Python
    path, every piece timed); returns the ones it had."""
    direct = engine.prepared.speedups.direct
    before, direct.native_layers = direct.native_layers, layers
    return before


def instrument(engine: Engine, clock: StepClock) -> list[tuple[int, int]]:
    """Timers on `engine`'s parts (module docstring); returns the (in, out) shapes of one
    decoder layer's linears."""
    prepared = engine.prepared
    base = prepared.base
    direct = prepared.speedups.direct
    if direct is None:
        raise SystemExit("the step profile needs the direct forward (CPU, a layer class it writes out)")
    shapes = _instrument_layers(clock, base)
    _instrument_direct(clock, direct, base)
    forward_module.build_step_inputs = clock.timed("step inputs", forward_module.build_step_inputs)
    direct_module.paged_attention_forward = clock.timed("attention", direct_module.paged_attention_forward)
    engine.forward.hidden_states = clock.timed("forward glue", engine.forward.hidden_states)
    engine.forward.sampling_hidden_states = clock.timed("forward glue", engine.forward.sampling_hidden_states)
    engine.sampling.logits = clock.timed("LM head + screen", engine.sampling.logits)
    _instrument_screen(clock, engine)
    engine.sampling.sample = clock.timed("sampling glue", engine.sampling.sample)
    engine.sampling.sampler.sample = clock.timed("sampler", engine.sampling.sampler.sample)
    engine.planner.plan = clock.timed("planning", engine.planner.plan)
    engine.sequences.commit = clock.timed("commit", engine.sequences.commit)
    engine.step = clock.step("engine Python", engine.step, classify)
    return shapes

