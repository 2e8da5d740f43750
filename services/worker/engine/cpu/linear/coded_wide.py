"""Wide steps of coded linears without a float32 copy of their weights (CPU_PREFILL_WEIGHTS).

A coded linear's few-row steps run from its codes (weight_codes.py); its wide steps (prefill
chunks of more than weight_codes.MAX_ROWS rows) can multiply a float32 pack of the weight,
kept resident beside the codes (`packs`: ~380 MB on the default model). Here each wide step
expands the linear's weight from its codes instead, into a scratch that all the model's
linears of its shape share (a few MB, so it stays in cache), and multiplies that.

Where oneDNN serves float32 GEMMs and its pack's layout is known on this CPU
(onednn_layout.py), the codes are expanded straight into a pack in that layout and oneDNN's
linear multiplies it as it multiplies its own pack: the same bytes, so the same kernel and
the same outputs bit for bit (checked once per shape against oneDNN's own reorder), at the
cost of one expansion per linear per wide step (~0.1 ms for 2048 x 640). Otherwise the
scratch holds the plain weight, which oneDNN reorders on each call (~0.3-1 ms), or torch's
linear multiplies it.

With a native GEMM (prefill_gemm.py, CPU_PREFILL_GEMM) the codes of a shape it serves are
expanded into its panels of 16 columns instead and it multiplies them; `prepare_gemm` decides per
shape, under `auto` only where its outputs are the path's it replaces bit for bit. On a CPU with
AMX the AMX GEMM (amx_gemm.py) multiplies the codes themselves, no weight expanded: under `auto`
where its outputs stay within a float32 GEMM's rounding bound and it runs faster.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch

from services.worker.engine.cpu.linear import onednn_layout
from services.worker.engine.cpu.linear.amx_gemm import AmxVerdict, NativeAmxGemm, decide_amx, settle
from services.worker.engine.cpu.linear.onednn_layout import BlockedPack
from services.worker.engine.cpu.linear.prefill_gemm import PANEL, NativePrefillGemm, Verdict, decide
from services.worker.engine.cpu.linear.weight_codes import CodedWeight, NativeCodedLinear

PREFILL_WEIGHTS_MODES = ("auto", "packs", "codes")

log = logging.getLogger(__name__)


class WideFromCodes:
    """rows [M, in] @ weight.T (+ bias) for a coded weight, expanded into a shared scratch.
    Steps run one at a time (the engine's thread), so one scratch serves every linear of a
    shape.

    With `onednn` the product is oneDNN's linear, on a pack written from the codes where
    `prepare` learned the pack's layout for the shape (the pack's speed), else on the plain
    weight (92-95 % of it at 512 rows, AMD EPYC Zen 5); without, torch's linear."""

    def __init__(self, kernel: NativeCodedLinear, onednn: bool, rows_hint: int = 512,
                 gemm: NativePrefillGemm | None = None, gemm_mode: str = "auto",
                 amx: NativeAmxGemm | None = None) -> None:
        self.kernel = kernel
        self.onednn = onednn
        self.rows_hint = rows_hint          # the row count oneDNN's packs are laid out for
        self.gemm, self.gemm_mode, self.amx = gemm, gemm_mode, amx
        self._scratch = torch.empty(0)      # a plain weight, or the native GEMM's panels [out / 16][in][16]
        self._packs: dict[tuple[int, int], BlockedPack | None] = {}
        self._native: dict[tuple[int, int], Verdict] = {}
        self._amx: dict[tuple[int, int], AmxVerdict] = {}
        self._amx_linears: Counter[tuple[int, int]] = Counter()    # linears a shape, for `settle_amx`
        self._amx_counted: set[int] = set()

    def prepare(self, coded: CodedWeight) -> bool:
        """Learns (once per shape) whether `coded`'s wide steps can multiply a pack written
        from its codes; whether they can."""
        shape = (coded.out_features, coded.in_features)
        if shape not in self._packs:
            self._packs[shape] = self._learn(coded) if self.onednn else None
        return self._packs[shape] is not None

    def prepare_gemm(self, coded: CodedWeight) -> bool:
        """Decides (once per shape, after `prepare`) whether the native GEMM serves `coded`'s
        wide steps (prefill_gemm.decide), and prepares the AMX GEMM's check against what serves
        them otherwise (`prepare_amx`; `settle_amx` decides); whether the native GEMM serves."""
        shape = (coded.out_features, coded.in_features)
        self.prepare(coded)
        if shape not in self._native and self.gemm is not None and coded.out_features % PANEL == 0:
            self._native[shape] = decide(self.gemm_mode, lambda x: self._native_product(x, coded),
                                         lambda x: self._library_product(x, coded, None), coded.in_features)
            log.info("prefill GEMM of %d x %d weights: %s", *shape, self._native[shape].describe())
        self.prepare_amx(coded, lambda x: self._product(x, coded, None))
        return self._serves(self._native, shape)

    def prepare_amx(self, coded: CodedWeight, otherwise: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Checks and times (once per shape) the AMX GEMM on `coded`'s wide steps, against
        `otherwise`, what would serve them (amx_gemm.decide_amx), and counts the linear; once
        every linear is prepared, `settle_amx` decides."""
        shape = (coded.out_features, coded.in_features)
        if self.amx is None:
            return
        if id(coded) not in self._amx_counted:        # each linear once, however often prepared
            self._amx_counted.add(id(coded))
            self._amx_linears[shape] += 1
        if shape not in self._amx:
            self._amx[shape] = decide_amx(self.gemm_mode, self.amx, coded, otherwise)
            log.info("prefill AMX GEMM of %d x %d weights: %s", *shape, self._amx[shape].describe())

    def settle_amx(self) -> bool:
        """Settles which shapes the AMX GEMM serves (amx_gemm.settle: under `auto` all or none);
        whether it serves every shape prepared."""
        self._amx = settle(self.gemm_mode, self._amx, self._amx_linears)
        if self._amx:
            log.info("prefill AMX GEMM: %d of %d shapes", self.amx_shapes(), len(self._amx))
        return bool(self._amx) and all(verdict.serves for verdict in self._amx.values())

    @staticmethod
    def _serves(verdicts: dict[tuple[int, int], Verdict] | dict[tuple[int, int], AmxVerdict],
                shape: tuple[int, int]) -> bool:
        return shape in verdicts and verdicts[shape].serves

    def _learn(self, coded: CodedWeight) -> BlockedPack | None:
        """A pack of the shape whose layout the codes can be written in, checked on `coded`:
        the bytes written equal oneDNN's own pack of the expanded weight."""
        pack = onednn_layout.learn(coded.out_features, coded.in_features, self.rows_hint)
        if pack is None:
            return None
        self.kernel.expand_blocked(coded, pack.address, pack.block)
        if onednn_layout.bytes_of(pack.tensor) != onednn_layout.pack_of(self.kernel.expand(coded), self.rows_hint):
            return None
        return pack

    def blocked_shapes(self) -> int:
        """Shapes whose wide steps multiply packs written from the codes."""
        return sum(pack is not None for pack in self._packs.values())

    def native_shapes(self) -> int:
        """Shapes whose wide steps the native GEMM serves (the AMX GEMM's not counted)."""
        return sum(verdict.serves and not self._serves(self._amx, shape) for shape, verdict in self._native.items())

    def amx_shapes(self) -> int:
        """Shapes whose wide steps the AMX GEMM serves."""
        return sum(verdict.serves for verdict in self._amx.values())

    def __call__(self, rows: torch.Tensor, coded: CodedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is None and self._serves(self._amx, (coded.out_features, coded.in_features)):
            assert self.amx is not None
            return self.amx(rows, coded)
        return self._product(rows, coded, bias)

    def _product(self, rows: torch.Tensor, coded: CodedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is None and self._serves(self._native, (coded.out_features, coded.in_features)):
            return self._native_product(rows, coded)
        return self._library_product(rows, coded, bias)

    def _scratch_for(self, coded: CodedWeight) -> torch.Tensor:
        """The shared scratch, grown to hold `coded`'s weight (steps run one at a time)."""
        entries = coded.in_features * coded.out_features
        if self._scratch.numel() < entries:
            self._scratch = torch.empty(entries)
        return self._scratch

    def _native_product(self, rows: torch.Tensor, coded: CodedWeight) -> torch.Tensor:
        panels = self._scratch_for(coded)
        self.kernel.expand_blocked(coded, panels.data_ptr(), PANEL)
        return self.gemm(rows, panels, coded.out_features)

    def _library_product(self, rows: torch.Tensor, coded: CodedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        pack = self._packs.get((coded.out_features, coded.in_features)) if self.onednn else None
        if pack is not None:
            self.kernel.expand_blocked(coded, pack.address, pack.block)
            return torch.ops.mkldnn._linear_pointwise(rows, pack.tensor, bias, "none", [], "")
        weight = self.kernel.expand_into(coded, self._scratch_for(coded))
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
        return torch.nn.functional.linear(rows, weight, bias)
