"""The LM head screen's one-row pass with and without the plane of its codes, in one engine.

    python -m benchmarks.screen_plane_bench              # default model, ~1 min
    python -m benchmarks.screen_plane_bench --decode-steps 96 --prefixes 16

Builds the default model's engine once with LM_HEAD_SCREEN_PLANE on and serves each step with
the plane or without it, alternating step by step (so a host whose memory bandwidth drifts, as
these do within minutes, moves both alike): batch-1 decode steps of three prompts, and the last
step of a 1,496-token prompt whose prefix is cached (a cold prompt, then the same document with
another last sentence, as `benchmarks.prefix_cache_bench` sends them). Prints a markdown table:
the median step and screen call of each, their ratio, the panels the plane left to the codes,
the plane's bytes, and whether both decoded the same tokens.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
from transformers import AutoTokenizer

from benchmarks.machine import cpu_name
from benchmarks.prefix_cache_bench import long_body, last_sentence
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu.screen.codes_plane import CodesPlane, ScreenedRow
from services.worker.engine.cpu.screen.lm_head_screen import LMHeadScreen
from services.worker.wiring import build_engine

PROMPTS = ("The history of the Roman Empire began", "In machine learning, gradient descent is")
PREFIX_TOKENS = 1496


class Timings:
    """Step and screen-call times by whether the plane served them, and the panels it left."""

    def __init__(self) -> None:
        self.steps: dict[tuple[str, bool], list[float]] = defaultdict(list)
        self.screens: dict[tuple[str, bool], list[float]] = defaultdict(list)
        self.panels: dict[str, list[int]] = defaultdict(list)
        self.kind = ""


def _one_row_screen(engine: Any) -> LMHeadScreen:
    """The engine's screen of one-row steps, which reads a plane (exits where none was built)."""
    screen = engine.prepared.screen.screen_for(1)
    if screen is None or screen._plane is None:
        raise SystemExit("the plane was not built here (it needs AVX2 and a Q8_0 head; see the worker's log)")
    return screen


def _instrument(timings: Timings) -> None:
    """Times every one-row screen call and counts the panels each plane pass left."""
    logits, screen_row = LMHeadScreen.logits, CodesPlane.screen_row

    def timed_logits(self: LMHeadScreen, hidden: torch.Tensor, *args: Any) -> Any:
        started = time.perf_counter()
        out = logits(self, hidden, *args)
        if hidden.shape[0] == 1 and timings.kind:
            timings.screens[(timings.kind, self._plane is not None)].append((time.perf_counter() - started) * 1e3)
        return out

    def counted(self: CodesPlane, *args: Any) -> ScreenedRow:
        row = screen_row(self, *args)
        if timings.kind:
            timings.panels[timings.kind].append(row.panels_read)
        return row

    LMHeadScreen.logits, CodesPlane.screen_row = timed_logits, counted    # type: ignore[method-assign]


def _step(engine: Any, screen: LMHeadScreen, plane: CodesPlane, use: bool, batch: StepBatch, kind: str,
          timings: Timings) -> list[int]:
    screen._plane = plane if use else None
    timings.kind = kind
    started = time.perf_counter()
    out = engine.step(batch)
    timings.steps[(kind, use)].append((time.perf_counter() - started) * 1e3)
    timings.kind = ""
    return [token for result in out.results for token in result.token_ids]


def run(decode_steps: int, prefixes: int) -> tuple[Timings, bool, int]:
    if not is_prepared(default_model_dir(default_cache_dir())):
        raise SystemExit("default model not prepared: run `make prepare-model` first")
    model_dir = str(default_model_dir(default_cache_dir()))
    engine = build_engine(EngineConfig(model_dir=model_dir, model_key="screen-plane-bench", lm_head_screen_plane=True))
    engine.wait_for_screen()
    screen = _one_row_screen(engine)
    plane = screen._plane
    assert plane is not None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    timings = Timings()
    _instrument(timings)
    prompts = [*PROMPTS, long_body(tokenizer, 7, 274)]
    decoded: dict[bool, list[int]] = {True: [], False: []}
    for use_first in (True, False):          # each prompt decoded twice, the plane on alternate steps
        for number, prompt in enumerate(prompts):
            ids = tokenizer(prompt)["input_ids"]
            seq = f"d{number}-{use_first}"
            engine.step(StepBatch(new_sequences=[NewSequence(seq, tuple(ids))], work=[WorkItem(seq, len(ids))]))
            for index in range(decode_steps):
                use = (index % 2 == 0) == use_first
                decoded[use_first].extend(_step(engine, screen, plane, use, StepBatch(work=[WorkItem(seq, 1)]),
                                                "decode", timings))
            engine.step(StepBatch(free_seq_ids=[seq]))
    for number in range(prefixes):
        body = long_body(tokenizer, 100 + number, PREFIX_TOKENS)
        cold = tuple(tokenizer(body + last_sentence(0))["input_ids"])
        warm = tuple(tokenizer(body + last_sentence(1))["input_ids"])
        engine.step(StepBatch(new_sequences=[NewSequence("cold", cold)], work=[WorkItem("cold", len(cold))]))
        engine.step(StepBatch(free_seq_ids=["cold"]))
        batch = StepBatch(new_sequences=[NewSequence("warm", warm)], work=[WorkItem("warm", len(warm))])
        _step(engine, screen, plane, number % 2 == 0, batch, "cached prefix", timings)
        engine.step(StepBatch(free_seq_ids=["warm"]))
    return timings, decoded[True] == decoded[False], plane.nbytes


def table(timings: Timings, same_tokens: bool, plane_bytes: int) -> str:
    lines = ["| one-row step | step, codes / plane (ms) | screen call, codes / plane (ms) | step ratio | "
             "panels the plane left (median, max of 8,192) |", "|---|---|---|---|---|"]
    for kind in ("decode", "cached prefix"):
        codes, plane = statistics.median(timings.steps[(kind, False)]), statistics.median(timings.steps[(kind, True)])
        screen_codes = statistics.median(timings.screens[(kind, False)])
        screen_plane = statistics.median(timings.screens[(kind, True)])
        panels = timings.panels[kind]
        lines.append(f"| {kind} (n = {len(timings.steps[(kind, True)])} each) | {codes:.2f} / {plane:.2f} | "
                     f"{screen_codes:.2f} / {screen_plane:.2f} | **{codes / plane:.2f}x** | "
                     f"{statistics.median(panels):.0f}, {max(panels)} |")
    lines.append("")
    lines.append(f"Plane {plane_bytes / 1e6:.0f} MB; the same greedy tokens with and without it: "
                 f"{'yes' if same_tokens else 'NO'}. {cpu_name()}, {torch.get_num_threads()} threads.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode-steps", type=int, default=96, help="decode steps a prompt, alternating")
    parser.add_argument("--prefixes", type=int, default=16, help="cached-prefix prompts, alternating")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(table(*run(args.decode_steps, args.prefixes)))


if __name__ == "__main__":
    main()
