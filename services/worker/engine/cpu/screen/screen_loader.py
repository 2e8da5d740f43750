"""When an engine's LM head screen (lm_head_screen.py) is built, and how many rows it serves.

Float32 CPU engines only: built at start-up (`on`), or for large vocabularies in a
background thread (`auto`: packing the int8 head takes seconds; steps use the full
head until it is ready), or not at all (`off`, other devices and dtypes, a head
with a bias). A failed build is logged and leaves the full head serving.

A head kept as 8-bit weight codes is screened from the codes themselves where the C kernel
builds (`LMHeadScreen.from_codes`: no int8 copy, 168 MB less on Gemma 3's head), with hidden
states rounded to int16 or to int8 (`LM_HEAD_SCREEN_ACTIVATIONS`; codes_screen_int8.py), or
under `auto` with both, each serving the steps it was timed faster on (screen_rows.py); any
other head from an int8 copy of its float32 weight.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from pathlib import Path

import torch

from services.worker.engine.config import EngineConfig, require_choice
from services.worker.engine.cpu.screen.codes_plane import CodesPlane
from services.worker.engine.cpu.screen.codes_screen_int8 import ACTIVATIONS
from services.worker.engine.cpu.host_memory import release_freed_host_memory
from services.worker.engine.cpu.library_pages import release_library_pages
from services.worker.engine.cpu.screen.int8_matmul import NativeInt8Matmul
from services.worker.engine.cpu.screen.lm_head_screen import LMHeadScreen, load_native_matmul
from services.worker.engine.cpu.screen.screen_fbgemm import screening_available
from services.worker.engine.cpu.screen.screen_rows import RowSplit, split_by_rows
from services.worker.engine.cpu.linear.weight_codes import CodedWeight

LM_HEAD_SCREEN_MODES = ("auto", "on", "off")
# What the screen multiplies: `auto` a head kept as 8-bit codes from its codes (no copy), any
# other from an int8 copy; `copy` an int8 copy always (168 MB more on Gemma 3's head, for a
# screen 15-40 % faster at 1-8 rows, where the codes' scales and offsets add a quarter to the
# bytes read and their per-block float work ~10-15 % to the multiply-adds).
LM_HEAD_SCREEN_WEIGHTS = ("auto", "copy")
MIN_SCREENED_VOCAB = 32768   # `auto` screens vocabularies this large, where the LM head dominates a decode
# Screened rows per step at most when LM_HEAD_SCREEN_MAX_ROWS is 0, by the screen's kernel: past
# these the full head was faster on a 2-core AMD EPYC (fbgemm's op costs two rows per row).
DEFAULT_SCREEN_MAX_ROWS = {"codes": 32, "native": 32, "fbgemm": 8}

log = logging.getLogger(__name__)


class ScreenLoader:
    def __init__(self, config: EngineConfig, softcap: float | None, kernel_cache_dir: Path,
                 native_kernels: bool) -> None:
        require_choice("LM head screen mode", config.lm_head_screen, LM_HEAD_SCREEN_MODES)
        require_choice("LM_HEAD_SCREEN_WEIGHTS", config.lm_head_screen_weights, LM_HEAD_SCREEN_WEIGHTS)
        require_choice("LM_HEAD_SCREEN_ACTIVATIONS", config.lm_head_screen_activations, ACTIVATIONS)
        if config.lm_head_screen_max_rows < 0:
            raise ValueError("lm_head_screen_max_rows must be >= 0 (0: by the screen's kernel)")
        self.mode = config.lm_head_screen
        self.from_codes = config.lm_head_screen_weights == "auto"
        self.activations = config.lm_head_screen_activations
        self.plane = config.lm_head_screen_plane
        self.setting_max_rows = config.lm_head_screen_max_rows
        self.screen: LMHeadScreen | None = None
        self._split: RowSplit | None = None        # int16 rounding for narrow steps (screen_rows.py)
        self._softcap = softcap
        self._kernel_cache_dir = kernel_cache_dir
        self._native_kernels = native_kernels
        self._ready = threading.Event()
        self._source: tuple[torch.Tensor, CodedWeight | None] | None = None

    def start(self, head: torch.nn.Module, device: torch.device, dtype: torch.dtype,
              weight: torch.Tensor | None = None, coded: CodedWeight | None = None) -> None:
        """Builds the screen of `head` now, in the background, or not, by the mode. `weight`:
        the head's float32 weight when the head no longer holds it, with `coded`, its codes,
        which the screen reads its exact rows from once built (coded_head.py)."""
        weight = weight if weight is not None else getattr(head, "weight", None)
        if (self.mode == "off" or device.type != "cpu" or dtype != torch.float32
                or weight is None or getattr(head, "bias", None) is not None):
            self._ready.set()
            return
        if self.mode != "on" and weight.shape[0] < MIN_SCREENED_VOCAB:
            self._ready.set()
            return
        # Handed over through the loader, not the call's arguments, so that the build
        # can let go of the last reference to the float32 head as soon as it is done.
        self._source = (weight, coded)
        del weight
        if self.mode == "on":
            self._build()
        else:
            threading.Thread(target=self._build, name="lm-head-screen", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the screen is built or known not to be."""
        return self._ready.wait(timeout)

    def screen_for(self, rows: int) -> LMHeadScreen | None:
        """The screen that serves a step sampling `rows` rows (None: the full head serves)."""
        return self._split.screen_for(rows) if self._split is not None else self.screen

    def max_rows(self, screen: LMHeadScreen) -> int:
        """Screened rows per step at most: the setting, or past where the full head is faster."""
        return self.setting_max_rows or DEFAULT_SCREEN_MAX_ROWS[screen.kernel]

    def _with_plane(self, screen: LMHeadScreen | None, native: NativeInt8Matmul,
                    coded: CodedWeight) -> LMHeadScreen | None:
        """`screen`, reading a plane of the codes on its one-row steps where LM_HEAD_SCREEN_PLANE
        asks for one and it is an int16 screen the plane's kernel serves (codes_plane.py)."""
        if self.plane and screen is not None and screen.activations == "int16":
            plane = CodesPlane.create(native, coded)
            if plane is not None:
                screen.use_plane(plane)
                log.info("LM head screen: one-row steps read a plane of the codes first (%.0f MB)", plane.nbytes / 1e6)
        return screen

    def _build(self) -> None:
        weight, coded = self._source
        self._source = None
        try:
            started = time.perf_counter()
            native = load_native_matmul(self._kernel_cache_dir) if self._native_kernels else None
            if native is None and not screening_available():
                return
            screen = None
            if self.from_codes and coded is not None and coded.bits == 8 and native is not None:
                screen = self._with_plane(LMHeadScreen.from_codes(coded, self._softcap, native, self.activations),
                                          native, coded)
                if screen is None:
                    log.warning("LM head screen: not from the head's codes; from an int8 copy of it instead")
                elif self.activations == "auto":
                    self._split = split_by_rows(screen, lambda: self._with_plane(
                        LMHeadScreen.from_codes(coded, self._softcap, native, "int16"), native, coded))
            if screen is None:     # no 8-bit codes or C kernel, or the codes kernel failed its check
                screen = LMHeadScreen.create(weight, self._softcap, native)
                if screen is not None and coded is not None:
                    screen.read_rows_from(coded)
            self.screen = screen
            if self.screen is not None:
                log.info("LM head screen ready in %.1f s (%s kernel, %s activations%s)", time.perf_counter() - started,
                         self.screen.kernel, self.screen.activations,
                         f"; int16 for steps of up to {self._split.few_rows} rows" if self._split is not None else "")
        except Exception:   # the full head keeps serving; the failure is only logged
            log.exception("LM head screen could not be built; the full LM head serves every row")
        finally:
            del weight                    # with codes, the last reference to the float32 head
            gc.collect()
            release_freed_host_memory()   # the quantization's temporaries (host_memory.py)
            release_library_pages()       # and the code only the build ran (library_pages.py)
            self._ready.set()
