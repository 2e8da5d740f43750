"""A decode step's decoder layers in one C call (native/decode_layers.c; CPU float32), and
those of a step of few prefill rows.

`DirectForward` runs each decoder layer as ~25 Python-level calls; on a decode step of
the default model their glue costs ~10 ms, as much as the matmuls of one sequence. For
Gemma 3 layers whose every piece is already one of the engine's C kernels (weight-code
projections, native norms and gated activation, native RoPE, native decode attention),
`NativeDecodeLayers` hands the whole stack of layers to one C function that calls the same
kernels in the same order, so the hidden states are bitwise the Python path's (the tests
compare them).

A step with prefill chunks and as few rows (a cached prompt's new tokens, a short last chunk,
alone or beside decodes) runs the same way, the chunks' attention the native prefill kernel's
paged entry over each chunk's keys where the pool holds them, as the Python path calls it
(step/attention.py): on a cached 1.5k-token prompt's 10 new tokens the Python layers' glue
(norms, activation, RoPE and projection calls one by one) was ~4 ms of a ~33 ms step. Steps
whose attention H2O scores, with more rows than the codes serve, or anything else keep the
Python path.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from services.worker.engine.step.attention import StepMetadata
from services.worker.engine.cpu.linear.cpu_linear import PackedLinear
from services.worker.engine.cpu.linear.fused_mlp import FusedGatedMLP
from services.worker.engine.cpu.linear.fused_norms import FusedRMSNorm
from services.worker.engine.cpu.linear.coded_groups import read_together
from services.worker.engine.cpu.kernels.native_build import NativeBuildError, load_library
from services.worker.engine.cpu.kernels.native_decode import VECTOR_WIDTH, NativeDecodeAttention, context_splits
from services.worker.engine.cpu.kernels.native_lora import LoraTables
from services.worker.engine.cpu.kernels.native_ops import ACTIVATIONS, NativeElementwise
from services.worker.engine.cpu.kernels.native_prefill import NativePrefillAttention
from services.worker.engine.cpu.linear.weight_codes import CodedWeight, NativeCodedLinear

if TYPE_CHECKING:
    from services.worker.engine.lora.layers import LoraRows

log = logging.getLogger(__name__)

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
JOINED = ("qkv", "gate_up")    # q, k, v and gate, up side by side (coded_groups.py), else no codes
NORMS = ("input_norm", "q_norm", "k_norm", "post_attention_norm", "pre_mlp_norm", "post_mlp_norm")
SCRATCH = ("normed", "q", "k", "v", "attn_out", "gate", "up", "act", "projected")


class _Coded(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("group", ctypes.c_int64), ("bits", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = ([(name, _Coded) for name in (*PROJECTIONS, *JOINED)]
                + [(name, ctypes.c_void_p) for name in (*NORMS, "k_cache", "v_cache", "cos", "sin",
                                                        "slots", "block_tables")]
                + [(name, ctypes.c_int64) for name in ("table_width", "window", "splits")]
                + [("scaling", ctypes.c_float)]
                + [(name, ctypes.c_void_p) for name in ("lora", "key_rows", "cu_q", "cu_k")])


class _Step(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_int64) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim",
                                                     "intermediate")]
                + [("eps", ctypes.c_float)]
                + [("ctx_lens", ctypes.c_void_p)]
                + [(name, ctypes.c_int64) for name in ("block_size", "activation", "num_threads")]
                + [(name, ctypes.c_void_p) for name in SCRATCH]
                + [(name, ctypes.c_void_p) for name in ("lora_slots", "lora_low")]
                + [(name, ctypes.c_int64) for name in ("chunks", "decodes")]
                + [("keep", ctypes.c_void_p), ("kept", ctypes.c_int64)])


class _Kernels(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("coded_linear", "rms_norm", "act_mul", "rope", "attention",
                                                     "prefill_attention")]


def _address(function: ctypes._CFuncPtr) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def _coded(linear: object) -> CodedWeight | None:
    return linear.coded if isinstance(linear, PackedLinear) and linear.bias is None else None


def _norm_scale(norm: object, eps: float) -> tuple[bool, int | None]:
    """(whether `norm` is a native norm with this eps, its scale's address or None)."""
    if not isinstance(norm, FusedRMSNorm) or norm.native is None or norm.eps != eps:
        return False, None
    return True, norm.scale.data_ptr() if norm.scale is not None else None


class _BuiltLayer(NamedTuple):
    structure: _Layer
    keep: list[torch.Tensor]        # what the structure points into
    activation: int                 # ACTIVATIONS' code of the gated MLP's activation
    max_rows: int                   # rows every projection's codes serve at most
    window: int | None              # sliding window, None for global attention


def _build_layer(layer: torch.nn.Module, eps: float) -> _BuiltLayer | None:
    """One Gemma 3 decoder layer as decode_layers.c's layer_t, when every projection runs from
    weight codes, every norm is a native norm with `eps` and the MLP a fused gated one; else None."""
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, FusedGatedMLP) or mlp.activation not in ACTIVATIONS:
        return None
    linears = dict(zip(PROJECTIONS, (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                     mlp.gate_proj, mlp.up_proj, mlp.down_proj)))
    coded = {name: _coded(linear) for name, linear in linears.items()}
    if any(weight is None for weight in coded.values()):
        return None
    norms = dict(zip(NORMS, (layer.input_layernorm, attn.q_norm, attn.k_norm, layer.post_attention_layernorm,
                             layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)))
    scales = {}
    for name, norm in norms.items():
        ok, address = _norm_scale(norm, eps)
        if not ok:
            return None
        scales[name] = address
    joined = dict(zip(JOINED, (read_together([linears["q"], linears["k"], linears["v"]]),
                               read_together([linears["gate"], linears["up"]]))))
    coded = {name: _coded(linear) for name, linear in linears.items()}   # views of the joined weights
    structure = _Layer(**{name: _Coded(w.codes.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr(), w.group,
                                            w.bits)
                          for name, w in (*coded.items(), *joined.items()) if w is not None}, **scales)
    structure.scaling = float(attn.scaling)
    return _BuiltLayer(structure, [t for w in coded.values() for t in (w.codes, w.scales, w.offsets)],
                       ACTIVATIONS[mlp.activation], min(linear.coded_max_rows for linear in linears.values()),
                       int(attn.sliding_window) if getattr(attn, "sliding_window", None) else None)


def _load_function(cache_dir: Path) -> ctypes._CFuncPtr | None:
    """fairserve_decode_layers from the compiled library, or None (logged) where it does not build."""
    try:
        library = load_library("decode_layers", cache_dir)
    except NativeBuildError as error:
        log.warning("native decode layers unavailable; the Python forward serves", extra={"reason": str(error)})
        return None
    function = library.fairserve_decode_layers
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return function


class NativeDecodeLayers:
    def __init__(self, function: ctypes._CFuncPtr, layers: list[_Layer], keep: list[torch.Tensor],
                 shape: dict[str, int], eps: float, activation: int, max_rows: int, windows: list[int | None],
                 layer_types: list[str | None], kernels: _Kernels) -> None:
        self._function = function
        self._layers = (_Layer * len(layers))(*layers)
        self._keep = keep                       # what the structures point into
        self._shape = shape
        self._eps = eps
        self._activation = activation
        self.max_rows = max_rows
        self._windows = windows
        self._layer_types = layer_types
        self._kernels = kernels
        q_width, kv_width = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
        # Each scratch buffer's row width (decode_layers.c's step_t).
        self._widths = dict(normed=max(shape["hidden"], q_width), q=q_width, k=kv_width, v=kv_width,
                            attn_out=q_width, gate=shape["intermediate"], up=shape["intermediate"],
                            act=shape["intermediate"], projected=shape["hidden"])
        self._attention_bound = False
        self._prefill_attention_bound = False
        self._lora_names: list[tuple[str, ...]] | None = None   # each layer's projections' module names
        self._lora_tables: LoraTables | None = None

    def serve_loras(self, names: list[tuple[str, ...]]) -> None:
        """Adapter rows too, from now on: `names` are each layer's projections' module names
        (q, k, v, o, gate, up, down), under which adapters hold their weights."""
        self._lora_names = names

    @property
    def serves_loras(self) -> bool:
        return self._lora_names is not None

    @classmethod
    def create(cls, base: torch.nn.Module, layer_types: list[str | None], native: NativeElementwise | None,
               cache_dir: Path) -> NativeDecodeLayers | None:
        """The C layers for `base`'s Gemma 3 decoder layers when every piece of them is a C
        kernel already (see the module docstring), else None."""
        layers = list(base.layers[:base.config.num_hidden_layers])
        if native is None or not layers or any(type(layer).__name__ != "Gemma3DecoderLayer" for layer in layers):
            return None
        eps = getattr(layers[0].input_layernorm, "eps", None)
        if not isinstance(eps, float):
            return None
        built: list[_BuiltLayer] = []
        for layer in layers:
            one = _build_layer(layer, eps)
            if one is None or (built and one.activation != built[0].activation):
                return None   # a layer that is not all C kernels, or a second activation
            built.append(one)
        config = base.config
        head_dim = layers[0].self_attn.head_dim
        shape = dict(hidden=config.hidden_size, heads=config.num_attention_heads,
                     kv_heads=config.num_key_value_heads, head_dim=head_dim,
                     intermediate=layers[0].mlp.gate_proj.out_features)
        if head_dim % VECTOR_WIDTH or head_dim % 2:
            return None
        function = _load_function(cache_dir)
        if function is None:
            return None
        coded_kernel: NativeCodedLinear = layers[0].self_attn.q_proj.coded_kernel
        kernels = _Kernels(coded_linear=_address(coded_kernel.linear_function),
                           rms_norm=_address(native.rms_norm_function), act_mul=_address(native.act_mul_function),
                           rope=_address(native.rope_function))
        return cls(function, [one.structure for one in built], [t for one in built for t in one.keep], shape, eps,
                   built[0].activation, min(one.max_rows for one in built), [one.window for one in built],
                   layer_types, kernels)

    def takes(self, meta: StepMetadata, rows: int) -> bool:
        """Whether this step is one the C layers run: few enough rows, its decodes (if any) with
        the native decode attention on the caches, its prefill chunks (if any) unscored, with the
        native prefill attention's paged entry on float32 caches."""
        if meta.num_tokens != rows or not 0 < rows <= self.max_rows:
            return False
        if meta.num_decodes and not self._takes_decodes(meta):
            return False
        return not meta.prefills or self._takes_prefills(meta)

    def _takes_decodes(self, meta: StepMetadata) -> bool:
        kernel = meta.decode_kernel
        if not isinstance(kernel, NativeDecodeAttention):
            return False
        if not self._attention_bound:
            self._kernels.attention = _address(kernel.attention_function)
            self._attention_bound = True
        return True

    def _takes_prefills(self, meta: StepMetadata) -> bool:
        kernel = meta.varlen.function if meta.varlen is not None and meta.varlen.paged is not None else None
        head_dim = self._shape["head_dim"]
        scored = meta.scores or (meta.sliding is not None and meta.sliding.scores)   # H2O reads the attention
        if scored or not isinstance(kernel, NativePrefillAttention) or not meta.varlen.supports(head_dim, head_dim):
            return False
        if not self._prefill_attention_bound:    # the caches' dtype is the engine's: checked once
            if any(cache is not None and cache.dtype != torch.float32 for cache in meta.kv.keys):
                return False
            self._kernels.prefill_attention = _address(kernel.paged_function)
            self._prefill_attention_bound = True
        return True

    def __call__(self, hidden: torch.Tensor, rotary: dict[str | None, tuple[torch.Tensor, torch.Tensor]],
                 meta: StepMetadata, lora: LoraRows | None = None, keep: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """hidden [rows, hidden] (contiguous float32) through every layer, in place; with `lora`
        (serves_loras only) each row's adapter update added after each projection. Returns the
        last layer's output: every row, or with `keep` (row indices) those rows in its order;
        without adapter rows and with `keep` ascending, the last layer finishes those rows alone
        (moved to the front of `hidden`) past its attention, as direct_forward.py's does."""
        rows = hidden.shape[0]
        finish = (keep.to(torch.int64).contiguous() if keep is not None and lora is None and keep.numel() > 0
                  and bool((keep[1:] > keep[:-1]).all()) else None)
        angles = {kind: (cos.reshape(rows, -1).contiguous(), sin.reshape(rows, -1).contiguous())
                  for kind, (cos, sin) in rotary.items()}
        pointed = self._point_at_decode_tables(meta) + self._point_at_prefill_keys(meta)
        for index, structure in enumerate(self._layers):
            layer = meta.cache_layer[index]
            structure.k_cache = meta.kv.keys[layer].data_ptr()
            structure.v_cache = meta.kv.values[layer].data_ptr()
            cos, sin = angles[self._layer_types[index]]
            structure.cos, structure.sin = cos.data_ptr(), sin.data_ptr()
            window = self._windows[index]
            limit = meta.for_layer(layer).sliding_window
            if limit and (window is None or window > limit):
                raise RuntimeError(f"layer {index} attends {window or 'all'} positions through the sliding cache")
            structure.window = window or 0
        lora_slots, lora_low = self._lora_step(lora)
        scratch = torch.empty(rows * sum(self._widths.values()))
        pointers, offset = {}, 0
        for name in SCRATCH:
            pointers[name] = scratch.data_ptr() + offset * scratch.element_size()
            offset += rows * self._widths[name]
        ctx_lens = meta.decode_ctx_lens.contiguous() if meta.num_decodes else None
        step = _Step(rows=rows, eps=self._eps, ctx_lens=ctx_lens.data_ptr() if ctx_lens is not None else None,
                     block_size=meta.block_size, activation=self._activation, num_threads=torch.get_num_threads(),
                     **self._shape, **pointers,
                     lora_slots=lora_slots.data_ptr() if lora_slots is not None else None,
                     lora_low=lora_low.data_ptr() if lora_low is not None else None,
                     chunks=len(meta.prefills), decodes=meta.num_decodes,
                     keep=finish.data_ptr() if finish is not None else None,
                     kept=finish.numel() if finish is not None else 0)
        if self._function(hidden.data_ptr(), ctypes.addressof(self._layers), len(self._layers),
                          ctypes.byref(step), ctypes.byref(self._kernels)):
            raise MemoryError("native decode layers: a kernel failed (attention scratch memory)")
        del pointed
        if finish is not None:
            return hidden[:finish.numel()]
        return hidden if keep is None else hidden[keep]

    def _point_at_decode_tables(self, meta: StepMetadata) -> list[torch.Tensor]:
        """Each layer's new K/V slots (every row's), and for the decode rows (if any) the block
        tables and context splits; returns what the structures point into (kept alive by the
        caller through the C call)."""
        decodes, longest = meta.num_decodes, meta.decode_ctx_range[1]
        threads = torch.get_num_threads()
        groups = {id(group): (group.slot_mapping.contiguous(), group.decode_block_tables.contiguous())
                  for group in (meta, meta.sliding) if group is not None}
        for index, structure in enumerate(self._layers):
            slots, tables = groups[id(meta.for_layer(meta.cache_layer[index]))]
            structure.slots = slots.data_ptr()
            structure.block_tables, structure.table_width = (tables.data_ptr(), tables.shape[1]) if decodes else (None, 0)
            window = self._windows[index]
            structure.splits = context_splits(decodes, self._shape["kv_heads"], threads,
                                       longest if window is None else min(longest, window)) if decodes else 1
        return [tensor for pair in groups.values() for tensor in pair]

    def _point_at_prefill_keys(self, meta: StepMetadata) -> list[torch.Tensor]:
        """Each layer's prefill chunks' keys (slots, cu_seqlens) under the layer's cache group and
        window, as attention.py's _varlen_prefill hands them to the kernel (none without chunks);
        returns what the structures point into."""
        keys: dict[tuple[int, int | None], tuple[torch.Tensor, ...]] = {}
        for index, structure in enumerate(self._layers):
            structure.key_rows = structure.cu_q = structure.cu_k = None
            if not meta.prefills:
                continue
            group, window = meta.for_layer(meta.cache_layer[index]), self._windows[index]
            found = keys.get((id(group), window))
            if found is None:
                cu_q, cu_k, _, _ = group.varlen_inputs(window)
                found = keys[(id(group), window)] = (
                    group.key_slots(window).to(torch.int64).contiguous(),
                    cu_q.to(torch.int32).contiguous(), cu_k.to(torch.int32).contiguous())
            structure.key_rows, structure.cu_q, structure.cu_k = (tensor.data_ptr() for tensor in found)
        return [tensor for found in keys.values() for tensor in found]


    def _lora_step(self, lora: LoraRows | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Points every layer at the LoRA tables of `lora`'s adapters (None: at none); the rows'
        slots and the rank scratch, kept alive by the caller through the C call."""
        if lora is None:
            for structure in self._layers:
                structure.lora = None
            return None, None
        if self._lora_names is None:
            raise RuntimeError("the C decode layers were not given the LoRA projections' names")
        if self._lora_tables is None or not self._lora_tables.matches(lora):
            self._lora_tables = LoraTables(self._lora_names, lora)
        tables = self._lora_tables
        for structure, layer_tables in zip(self._layers, tables.layers):
            structure.lora = ctypes.addressof(layer_tables)
        return tables.slots(lora), torch.empty(tables.max_rank)
