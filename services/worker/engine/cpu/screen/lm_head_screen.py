"""Exact greedy and top-k logits without the whole float32 LM head (CPU).

A CPU decode step streams every weight of the LM head (671 MB in float32 on
Gemma 3's 262k x 640 head) to pick one token per row. The screen first gives
every token an approximate logit from an int8 copy of the head (per-row scale,
one fbgemm call, a quarter of the bytes) together with a guaranteed bound on
its error,

    |x.w_r - approx_r| <= |x| * |w_r - q(w_r)| + |x - q(x)| * |q(w_r)| + slack

(Cauchy-Schwarz on the weight and the activation rounding). A token whose
upper bound is below the k-th best exact logit cannot be among the k best, so
only the others (a handful for greedy rows, a few hundred for top-64) get
exact float32 logits; every other entry of the returned row is -inf. Greedy and
top-k sampling over that row pick exactly what they pick over the full row.
Tokens whose logits the sampler changes (penalties, min_tokens bans) are given
exact logits always, and are left out of the thresholds.

Without the engine's C kernels the approximate logits come from fbgemm's int8 op
(screen_fbgemm.py).

Where the engine's C kernels build (`native/int8_matmul.c`, bound in `int8_matmul.py`), the
approximate logits come from it instead: activations rounded per row to int16 (|q(x)| <= 16383,
so 127 * hidden * |q(x)| stays an exact int32 sum) times the same int8 rows, the weight streamed
once for up to 8 rows.

Where the head is kept as 8-bit weight codes (weight_codes.py: the float32 head is
scale * code + offset in every block of 16 or 32 inputs; Gemma's Q8_0 head is), the screen
needs no int8 copy at all (`from_codes`): the same C kernel multiplies the int16 rows with
the codes themselves, exactly in int32 within each block, and applies each block's scale
and offset in float32. The weight side of the bound is then exact, and what is left of
|x| * |w_r - q(w_r)| is the kernel's float32 rounding (codes_screen_bound.py). Or the rows
are int8 with a scale per block (codes_screen_int8.py: faster, a few more candidates). One-row
steps may read a 4-bit plane of the codes first (codes_plane.py, LM_HEAD_SCREEN_PLANE).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from services.worker.engine.cpu.screen.codes_plane import CodesPlane
from services.worker.engine.cpu.screen.codes_screen_bound import coded_row_norms, codes_error_norms, codes_kernel_within_bound
from services.worker.engine.cpu.screen.codes_screen_half import HalfScales, checked_half_scales
from services.worker.engine.cpu.screen.codes_screen_int8 import ACTIVATIONS, INT8_GRID, faster_activations, int8_available
from services.worker.engine.cpu.screen.codes_screen_int8 import approximate as int8_approximate
from services.worker.engine.cpu.screen.int8_matmul import (CODES_TILE, MAX_PICK, PANEL, BoundNorms, NativeInt8Matmul,
                                                    PickScratch, ReusedRows)
from services.worker.engine.cpu.kernels.native_build import load_binding
from services.worker.engine.cpu.screen.screen_fbgemm import FbgemmHead, screening_available
from services.worker.engine.cpu.screen.screen_int8_copy import NORM_MARGIN, native_kernel_exact, quantize_rows
from services.worker.engine.cpu.linear.weight_codes import CodedWeight

log = logging.getLogger(__name__)

# Rounding, relative to |x| * max |q(w_r)|: the int8 op's float output (within ~1e-8 of
# float64, checked at create) and the bound's own arithmetic take OP_SLACK; the float32
# dot products of the exact logits (the threshold's and a candidate's) take the
# worst-case summation error of `hidden` terms, 2 * hidden * 2^-24 (slack_per_norm).
OP_SLACK = 1e-5
CHECK_ROWS = 4096           # vocabulary rows the check at create compares
INT16_GRID = 16383          # native kernel: activation rows are integers in [-INT16_GRID, INT16_GRID]
INT32_MAX = 2 ** 31 - 1
# Candidates the C kernel's first pass (against the widest bound) collects before torch's
# nonzero takes over; most are dropped by their own bounds right after.
FIRST_PASS_CAPACITY = 4 * 32768


def load_native_matmul(cache_dir: Path) -> NativeInt8Matmul | None:
    return load_binding(NativeInt8Matmul, "int8_matmul", cache_dir, "the LM head screen uses fbgemm's op")


class LMHeadScreen:
    MAX_TOP_K = 64                  # top-k rows screened up to this k (Gemma's default top_k is 64)
    MAX_ADJUSTED_TOKENS = 4096      # rows whose sampler adjusts more tokens take the full head
    MAX_CANDIDATES = 32768          # exact logits per call at most (1/8 of Gemma 3's vocabulary)

    def __init__(self, weight: torch.Tensor, softcap: float | None = None,
                 native: NativeInt8Matmul | None = None) -> None:
        """`weight`: the float32 LM head [vocab, hidden] (kept by reference, not copied).
        `native`: the C kernel for the approximate logits; None uses fbgemm's op."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("the LM head screen needs a float32 CPU weight")
        self.weight: torch.Tensor | None = weight.detach()
        self._coded: CodedWeight | None = None     # where exact logits read rows, once weight is let go
        self._from_codes = False                   # approximate logits from the codes (from_codes)
        self._half_scales: HalfScales | None = None     # the codes' scales as half floats (codes_screen_half.py)
        self._pick_scratch: PickScratch | None = None   # the C pick's candidates, made at its first step
        self._plane: CodesPlane | None = None       # one-row passes from the codes' high nibbles (use_plane)
        self._approx_rows = ReusedRows()           # `logits`' approximate logits, reused step to step
        self._logits_rows = ReusedRows()           # its returned rows where the C pick does not take them
        self.activations = "int16"                 # how hidden states are rounded for the kernel
        self.softcap = softcap
        vocab, hidden = self.weight.shape
        self._vocab, self._hidden = vocab, hidden
        quantized, scales, error_norms, quant_norms = quantize_rows(self.weight)
        self._native = native
        self._int16_grid = min(INT16_GRID, INT32_MAX // (127 * hidden))
        if native is not None:
            # The scales were computed in float32, so the float copy is exact.
            self._panels = native.pack(quantized, scales.float())
            self._packed = None
        else:
            self._packed = FbgemmHead(quantized, scales)
        self._set_norms(error_norms, quant_norms)
        self._check: tuple[torch.Tensor, torch.Tensor] | None
        check_rows = min(vocab, CHECK_ROWS)
        self._check = (quantized[:check_rows].clone(), scales[:check_rows].clone())

    @classmethod
    def create(cls, weight: torch.Tensor, softcap: float | None = None,
               native: NativeInt8Matmul | None = None) -> LMHeadScreen | None:
        """A screen for `weight`, or None where the int8 op is missing or fails its check."""
        if (native is None and not screening_available()) or weight.shape[1] < 2:
            return None
        return cls(weight, softcap, native)._checked()

    @classmethod
    def from_codes(cls, coded: CodedWeight, softcap: float | None, native: NativeInt8Matmul | None,
                   activations: str = "int16") -> LMHeadScreen | None:
        """A screen of the head `coded` stands for, from its 8-bit codes alone (no int8 copy,
        no float32 weight), or None without the C kernel, for narrow codes, or where the
        kernel fails its check. `activations`: int16, int8 (where its kernel runs and passes
        its check, else int16) or auto (the faster here; codes_screen_int8.py)."""
        if native is None or coded.bits != 8 or coded.in_features < 2:
            return None
        if activations not in ACTIVATIONS:
            raise ValueError(f"screen activations {activations!r}: one of {', '.join(ACTIVATIONS)}")
        if activations == "auto":
            activations = faster_activations(native, coded)
        elif activations == "int8" and not int8_available(native, coded):
            log.warning("LM head screen: no int8 kernel for these codes on this CPU; int16 activations")
            activations = "int16"
        screen = cls.__new__(cls)
        screen._init_from_codes(coded, softcap, native, activations)
        checked = screen._checked()
        if checked is None and activations == "int8":
            return cls.from_codes(coded, softcap, native, "int16")      # the int16 kernel, checked on its own
        return checked

    def _init_from_codes(self, coded: CodedWeight, softcap: float | None, native: NativeInt8Matmul,
                         activations: str) -> None:
        self.weight = None
        self._coded = coded                        # exact rows and approximate logits alike
        self._from_codes = True
        self.activations = activations
        self.softcap = softcap
        self._vocab, self._hidden = coded.out_features, coded.in_features
        self._native = native
        self._panels = self._packed = None
        self._int16_grid = INT16_GRID              # the block sums stay exact int32 for any int16
        self._pick_scratch, self._plane = None, None
        self._approx_rows, self._logits_rows = ReusedRows(), ReusedRows()
        self._half_scales = checked_half_scales(native, coded, INT16_GRID) if activations == "int16" else None
        grid = INT8_GRID if activations == "int8" else self._int16_grid
        row_norms, alpha_norms = coded_row_norms(coded, PANEL)
        self._set_norms(codes_error_norms(alpha_norms, coded, grid, NORM_MARGIN),
                        row_norms * (1 + NORM_MARGIN))       # the weight itself: nothing rounded
        self._check = None

    def _set_norms(self, error_norms: torch.Tensor, quant_norms: torch.Tensor) -> None:
        """The per-row norms the bound reads, their maxima (the first pass's widest bound) and
        the slack for the exact logits' float32 dot products."""
        self._error_norms, self._quant_norms = error_norms, quant_norms
        self._max_error_norm = float(error_norms.max())
        self._max_quant_norm = float(quant_norms.max())
        self._slack_per_norm = (OP_SLACK + 2 * self._hidden * 2.0 ** -24) * self._max_quant_norm
        self._bound_norms = BoundNorms(error_norms.float().contiguous(), quant_norms.float().contiguous(),
                                       self._slack_per_norm, self._max_error_norm, self._max_quant_norm)

    def _checked(self) -> LMHeadScreen | None:
        """This screen once its kernel passed `self_check`, else None (logged)."""
        passed = self.self_check()
        self._check = None
        if not passed:
            log.warning("LM head screen disabled: its %s kernel does not match its float64 reference here",
                        self.kernel)
            return None
        return self

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def read_rows_from(self, coded: CodedWeight) -> None:
        """Exact logits from rows expanded from `coded` (the same float32 values, bit for
        bit) instead of the float32 weight, which the screen then lets go."""
        if (coded.out_features, coded.in_features) != (self._vocab, self._hidden):
            raise ValueError("codes of another shape than the screened head")
        self._coded, self.weight = coded, None

    def self_check(self) -> bool:
        """The op on grid rows of extreme and random integers equals the float64 product
        of the dequantized weights to within its float32 rounding."""
        if self._from_codes:
            return self._codes_check()
        assert self._check is not None, "checked once, at create"
        quantized, scales = self._check
        generator = torch.Generator().manual_seed(0)
        if self._native is not None:
            return native_kernel_exact(self._native, quantized, scales, self._int16_grid, generator)
        assert self._packed is not None
        return self._packed.check(quantized.double() * scales[:, None], generator)

    def _codes_check(self) -> bool:
        """The codes kernel in use within the rounding part of its bound (codes_screen_bound.py)."""
        assert self._coded is not None and self._native is not None
        rows = min(self._vocab, CHECK_ROWS - 7)    # the last panel padded once there are that many
        return codes_kernel_within_bound(self._native, self._coded.panel_rows(0, rows), self._error_norms[:rows],
                                         self.activations, self._int16_grid, CODES_TILE + 3)

    @property
    def kernel(self) -> str:
        """What computes the approximate logits: codes (the C kernel from the head's weight
        codes), native (the C kernel from an int8 copy) or fbgemm."""
        if self._from_codes:
            return "codes"
        return "native" if self._native is not None else "fbgemm"

    def logits(self, hidden: torch.Tensor, top_counts: Sequence[int],
               adjusted: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """hidden [B, H] final hidden states -> [B, vocab] logits, exact (softcapped if the
        model caps them) at every token that can be among row b's `top_counts[b]` best
        once the sampler has adjusted the tokens `adjusted[b]`, and at those tokens;
        -inf elsewhere. None when screening would not pay: non-finite hidden states, or
        more candidates than MAX_CANDIDATES (the bound is loose for this input). The rows are
        the screen's own (ReusedRows), overwritten by its next call: read them before."""
        if self._picks_natively(top_counts, adjusted):
            return self._picked(hidden, top_counts)
        x = hidden.float()
        if not bool(torch.isfinite(x).all()):
            return None
        rows = x.shape[0]
        vocab = self.vocab_size
        approx, activation_error, maxima = self._approximate(x, self._approx_rows.take(rows, vocab))
        norms = x.norm(dim=1)

        # Exact logits of the best approximate tokens give each row a threshold: the
        # top_counts[b]-th best exact logit among tokens the sampler leaves alone.
        adjusted_ids = [torch.tensor(list(ids), dtype=torch.long) for ids in adjusted]
        widest = max(count + len(ids) for count, ids in zip(top_counts, adjusted_ids))
        best_ids = (self._native.top_k(approx, min(widest, vocab), maxima) if self._native is not None
                    else approx.topk(min(widest, vocab), dim=1).indices)
        best_exact = self._exact(x, torch.arange(rows)[:, None].expand_as(best_ids), best_ids)
        thresholds = torch.empty(rows)
        for row, (count, ids) in enumerate(zip(top_counts, adjusted_ids)):
            values = best_exact[row]
            if len(ids):
                values = values[~torch.isin(best_ids[row], ids)]
            # Fewer left alone than asked for (a tiny vocabulary): every token is a candidate.
            thresholds[row] = values.topk(count).values[-1] if count <= len(values) else float("-inf")

        # Candidates: first against the widest bound any token has, then each its own.
        widest_bound = self._bound(norms, activation_error, self._max_error_norm, self._max_quant_norm)
        cand_rows, cand_ids = self._first_candidates(approx, thresholds - widest_bound, maxima)
        upper = approx[cand_rows, cand_ids] + self._bound(norms[cand_rows], activation_error[cand_rows],
                                                          self._error_norms[cand_ids], self._quant_norms[cand_ids])
        keep = upper >= thresholds[cand_rows]
        cand_rows, cand_ids = cand_rows[keep], cand_ids[keep]
        if len(cand_ids) > self.MAX_CANDIDATES:
            return None

        extra_rows = [torch.full((len(ids),), row, dtype=torch.long) for row, ids in enumerate(adjusted_ids)]
        all_rows = torch.cat([cand_rows, *extra_rows])
        all_ids = torch.cat([cand_ids, *adjusted_ids])
        out = self._logits_rows.take(rows, vocab).fill_(float("-inf"))
        out[all_rows, all_ids] = self._capped(self._exact(x, all_rows, all_ids))
        out[torch.arange(rows)[:, None], best_ids] = self._capped(best_exact)
        return out

    def share_rows(self, other: LMHeadScreen) -> None:
        """Writes its approximate and logits rows into `other`'s: two screens of one head that
        serve steps in turn (screen_rows.py) need one set between them."""
        self._approx_rows, self._logits_rows = other._approx_rows, other._logits_rows
        self._pick_scratch = None

    def release_rows(self) -> None:
        """Lets its reused rows go (they come back at the width of the next steps)."""
        self._approx_rows.release()
        self._logits_rows.release()

    def _picks_natively(self, top_counts: Sequence[int], adjusted: Sequence[Sequence[int]]) -> bool:
        """Whether `logits` takes the C path around the kernel (native/screen_pick.c): int16
        rows against the head's 8-bit codes, no token adjusted by any row's sampler, and no
        row reading more best tokens than the pick takes (at most one per panel)."""
        return (self._from_codes and self.activations == "int16" and self._native is not None
                and self._coded is not None and self._coded.bits == 8 and not any(len(ids) for ids in adjusted)
                and max(top_counts) <= min(MAX_PICK, self.vocab_size // PANEL))

    def _picked(self, hidden: torch.Tensor, top_counts: Sequence[int]) -> torch.Tensor | None:
        """`logits` in three C calls: the rows rounded with their norms, the kernel's pass, and
        the pick of every token that can be among each row's best (the same candidates' bound,
        the same exact logits)."""
        assert self._native is not None and self._coded is not None
        x = hidden.float().contiguous()
        quantized = self._native.screen_quantize(x, self._int16_grid)
        if quantized is None:
            return None
        if self._plane is not None and x.shape[0] == 1:     # the plane, then the panels it leaves (codes_plane.py)
            row = self._plane.screen_row(x, quantized, top_counts[0], self._bound_norms,
                                         self._approx_rows.take(1, self.vocab_size))
            approx, maxima = row.approx, row.maxima
        else:
            maxima = torch.empty(x.shape[0], -(-self.vocab_size // PANEL))
            approx = self._native.codes_screen(self._coded, quantized.q, quantized.scale, maxima,
                                               self._half_for(x.shape[0]),
                                               self._approx_rows.take(x.shape[0], self.vocab_size))
        if self._pick_scratch is None:
            self._pick_scratch = PickScratch(self.MAX_CANDIDATES, self._logits_rows)
        picked = self._native.screen_pick(approx, maxima, list(top_counts), x, quantized, self._bound_norms,
                                          self._coded, self._pick_scratch)
        if picked is None:
            return None
        if self.softcap:
            picked.logits[picked.rows, picked.ids] = self._capped(picked.values)
        return picked.logits

    def use_plane(self, plane: CodesPlane) -> None:
        """One-row steps read `plane` (of this screen's codes) first (int16 rows, the C pick)."""
        if not (self._from_codes and self.activations == "int16" and plane.coded is self._coded):
            raise ValueError("a codes plane serves the int16 screen of the same codes")
        self._plane = plane

    def _half_for(self, rows: int) -> HalfScales | None:
        """The half scales where they serve this many rows, else None (the float ones)."""
        return self._half_scales if self._half_scales is not None and self._half_scales.serves(rows) else None

    def _first_candidates(self, approx: torch.Tensor, floors: torch.Tensor,
                          maxima: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, ids) of the approximate logits at or above their row's floor, row-major."""
        if self._native is not None:
            selected = self._native.select_above(approx, floors, FIRST_PASS_CAPACITY, maxima)
            if selected is not None:
                return selected
        rows, ids = torch.nonzero(approx >= floors[:, None], as_tuple=True)
        return rows, ids

    def approximate_with_bound(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(approximate logits [B, vocab], a bound on each one's error [B, vocab]): what
        `logits` screens with, written out for the whole vocabulary."""
        x = x.float()
        approx, activation_error, _ = self._approximate(x)
        norms = x.norm(dim=1)
        return approx, self._bound(norms[:, None], activation_error[:, None], self._error_norms, self._quant_norms)

    def _bound(self, norms: torch.Tensor, activation_error: torch.Tensor,
               error_norms: torch.Tensor | float, quant_norms: torch.Tensor | float) -> torch.Tensor:
        """|x| * |w - q(w)| + |x - q(x)| * |q(w)| + slack, elementwise over broadcast operands
        (from the codes: the kernel's float32 rounding in place of |w - q(w)|, and q(w) = w)."""
        return norms * (error_norms + self._slack_per_norm) + activation_error * quant_norms

    def _approximate(self, x: torch.Tensor,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(approximate logits [B, vocab], in `out` where the C kernel computes them and it is
        given; |x - q(x)| per row; the logits' maxima per panel of PANEL tokens where the C kernel
        computes them, else None)."""
        if self._native is not None:
            return self._approximate_native(x, out)
        assert self._packed is not None
        approx, activation_error = self._packed.approximate(x)
        return approx, activation_error, None

    def _approximate_native(self, x: torch.Tensor,
                            out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One int16 (or from the codes int8) row per row through the C kernel."""
        assert self._native is not None
        rows = x.shape[0]
        maxima = torch.empty(rows, -(-self.vocab_size // PANEL))
        if self.activations == "int8":
            approx, residual = int8_approximate(self._native, self._coded, x, maxima, out)
            return approx, residual.norm(dim=1) * (1 + 1e-4) + x.norm(dim=1) * 2.0 ** -22 + 1e-30, maxima
        scale = (x.abs().amax(dim=1) / self._int16_grid).clamp_min(1e-30)
        rounded = (x / scale[:, None]).round_().clamp_(-self._int16_grid, self._int16_grid)
        residual = x - rounded * scale[:, None]
        if self._from_codes:
            approx = self._native.codes_screen(self._coded, rounded.to(torch.int16), scale, maxima,
                                               self._half_for(rows), out)
        else:
            approx = self._native(self._panels, rounded.to(torch.int16), scale, maxima)
        # The residual is computed in float32: its rounding is below 2^-24 |x| per entry, far
        # more than the relative margin covers when the residual itself is that small.
        return approx, residual.norm(dim=1) * (1 + 1e-4) + x.norm(dim=1) * 2.0 ** -22 + 1e-30, maxima

    def _exact(self, x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits of token ids[i] for row rows[i], before any softcap (the bounds
        and thresholds live there; the cap is monotone, so it keeps their order). The C kernel
        reads each weight row in place; torch's path gathers a [N, hidden] copy first (on a
        first token after a prompt N can be thousands: 16k candidates took ~100 ms that way)."""
        if self._coded is not None:
            if self._native is not None and self._coded.bits == 8:
                return self._native.codes_gather_dot(self._coded, x, rows, ids).view(ids.shape)
            gathered = self._coded.rows(ids)
            if self._native is not None:
                positions = torch.arange(gathered.shape[0])
                return self._native.gather_dot(gathered, x, rows, positions).view(ids.shape)
            return (gathered * x[rows.reshape(-1)]).sum(dim=-1).view(ids.shape)
        if self._native is not None and self.weight.is_contiguous():
            return self._native.gather_dot(self.weight, x, rows, ids).view(ids.shape)
        return (self.weight[ids.reshape(-1)] * x[rows.reshape(-1)]).sum(dim=-1).view(ids.shape)

    def _capped(self, values: torch.Tensor) -> torch.Tensor:
        if not self.softcap:
            return values
        return torch.tanh(values / self.softcap) * self.softcap
