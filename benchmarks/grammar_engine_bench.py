"""Grammar engines compared on the default model's vocabulary: xgrammar against llguidance.

    make bench-grammar                                   # installs xgrammar, then the full run
    python -m benchmarks.grammar_engine_bench            # full run (about a minute)
    python -m benchmarks.grammar_engine_bench --quick    # fewer tokens and repeats

xgrammar is not part of `make install` (requirements-bench.txt: it pulls in triton, which torch
would then import into every service).

For each engine: the tokenizer set-up, the compile time of each case (a JSON schema, a regex,
a choice, a Lark grammar), whether it compiles at all (coverage), and the time to compute the
next-token mask per token at batch 1 and batch 8, while the matchers walk through outputs
drawn from seeded random logits under the mask (the way a constrained decode walks). Batch 8
is timed with xgrammar's parallel batch call and llguidance's row-by-row fill (its parallel
executor was 20x slower on 2 vCPUs). Also the time to apply an 8-row mask to
[8, vocab] float32 logits. Prints markdown tables (docs/engine/structured-output.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.machine import cpu_name
from common.model_store import default_cache_dir, default_model_dir

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 4},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}

CASES: dict[str, tuple[str, object]] = {
    "json_object (any JSON)": ("json", {"type": "object"}),
    "nested object, enum, array, required, ranges": ("json", PERSON),
    "anyOf + $ref/$defs": ("json", {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"]}},
        "anyOf": [{"$ref": "#/$defs/point"}, {"type": "array", "items": {"$ref": "#/$defs/point"}}]}),
    "exclusive ranges, multipleOf": ("json", {"type": "object", "properties": {
        "p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "n": {"type": "integer", "multipleOf": 5}}, "required": ["p", "n"]}),
    "string formats (date-time, email)": ("json", {"type": "object", "properties": {
        "when": {"type": "string", "format": "date-time"}, "who": {"type": "string", "format": "email"}},
        "required": ["when", "who"]}),
    "regex (phone number)": ("regex", r"\+?[0-9]{1,3}-[0-9]{3}-[0-9]{4}"),
    "choice (3 strings)": ("choice", ["positive", "negative", "neutral"]),
    "Lark grammar (arithmetic)": ("lark", 'start: expr\nexpr: term (("+"|"-") term)*\n'
                                          'term: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n'),
}


def choice_regex(choices: list[str]) -> str:
    return "|".join("(" + "".join("\\" + c if not c.isalnum() else c for c in choice) + ")" for choice in choices)


@dataclass
class Walk:
    mask_ms: list[float]
    tokens: int


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int) -> None:
        import llguidance
        import llguidance.numpy as lnp
        self.ll, self.lnp = llguidance, lnp
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
        self.vocab = vocab

    def compile(self, kind: str, value: object):
        m = self.ll.LLMatcher
        grammar = {"json": lambda: m.grammar_from_json_schema(value, defaults={"whitespace_flexible": False}),
                   "regex": lambda: m.grammar_from_regex(value),
                   "choice": lambda: m.grammar_from_regex(choice_regex(value)),
                   "lark": lambda: m.grammar_from_lark(value)}[kind]()
        matcher = m(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        matcher.compute_bitmask()      # the first mask: llguidance builds lazily
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()    # what the worker does: a copy of the cached compiled matcher

    def allocate(self, rows: int) -> np.ndarray:
        return self.lnp.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matchers, bitmask: np.ndarray) -> None:
        # Row by row: LLExecutor's parallel call took 5-7 ms for 8 rows on 2 busy vCPUs, 20x this.
        for row, matcher in enumerate(matchers):
            self.lnp.fill_next_token_bitmask(matcher, bitmask, row)

    @staticmethod
    def advance(matcher, token: int) -> bool:
        return matcher.consume_token(token) and not matcher.is_stopped()


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, model_dir: Path, vocab: int) -> None:
        try:
            import xgrammar
        except ImportError as error:
            raise SystemExit("xgrammar is not installed: `make bench-grammar` installs it "
                             "(requirements-bench.txt)") from error
        from transformers import AutoTokenizer
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()
        self.vocab = vocab

    def compile(self, kind: str, value: object):
        c = self.compiler
        return {"json": lambda: c.compile_json_schema(value, any_whitespace=False),
                "regex": lambda: c.compile_regex(value),
                "choice": lambda: c.compile_regex(choice_regex(value)),
                "lark": lambda: c.compile_lark(value)}[kind]()

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def allocate(self, rows: int) -> np.ndarray:
        return self.xgr.allocate_token_bitmask(rows, self.vocab).numpy()

    def fill(self, matchers, bitmask: np.ndarray) -> None:
        import torch
        tensor = torch.from_numpy(bitmask)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(tensor, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, tensor)

    @staticmethod
    def advance(matcher, token: int) -> bool:
        return matcher.accept_token(token) and not matcher.is_terminated()


def allowed_rows(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)


def walk(engine, compiled, rows: int, tokens: int, seed: int) -> Walk:
    """Mask times while `rows` matchers each take `tokens` tokens, drawn by argmax of seeded
    random logits under the mask; a matcher that finishes starts over."""
    rng = np.random.default_rng(seed)
    matchers = [engine.matcher(compiled) for _ in range(rows)]
    bitmask = engine.allocate(rows)
    times: list[float] = []
    for _ in range(tokens):
        started = time.perf_counter()
        engine.fill(matchers, bitmask)
        times.append((time.perf_counter() - started) * 1000.0)
        allowed = allowed_rows(bitmask, engine.vocab)
        logits = rng.standard_normal((rows, engine.vocab), dtype=np.float32)
        picks = np.where(allowed, logits, -np.inf).argmax(axis=1)
        for row, token in enumerate(picks.tolist()):
            if not allowed[row, token] or not engine.advance(matchers[row], token):
                matchers[row] = engine.matcher(compiled)
    return Walk(times, tokens)


def timed(function: Callable[[], object], repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        best = min(best, (time.perf_counter() - started) * 1000.0)
    return best, result


def mask_apply_ms(vocab: int, rows: int, repeats: int = 50) -> float:
    """Applying the rows' masks to float32 logits the way the worker's sampler does (the bits
    unpacked in the mask thread, then -inf copied in where banned, row by row)."""
    import torch
    logits = torch.randn(rows, vocab)
    bitmask = np.full((rows, (vocab + 31) // 32), 0x0F0F0F0F, dtype=np.int32)
    banned = ~allowed_rows(bitmask, vocab)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for row in range(rows):
            np.copyto(logits[row].numpy(), -np.inf, where=banned[row])
        times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    model_dir = args.model_dir or default_model_dir(default_cache_dir())
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    eos = config.get("eos_token_id", 1)
    eos = eos[0] if isinstance(eos, list) else eos
    tokens, repeats = (16, 1) if args.quick else (64, 3)
    print(f"{cpu_name()}, vocabulary {vocab} ({model_dir.name}), {tokens} tokens per walk\n")

    engines = []
    for make in (lambda: LLGuidanceEngine((model_dir / "tokenizer.json").read_text(), vocab, eos),
                 lambda: XGrammarEngine(model_dir, vocab)):
        setup_ms, engine = timed(make, 1)
        engines.append(engine)
        print(f"{engine.name}: tokenizer set-up {setup_ms:.0f} ms")
    print()
    print("| case | " + " | ".join(f"{e.name} compile ms | {e.name} mask ms b1 | {e.name} mask ms b8"
                                   for e in engines) + " |")
    print("|---|" + "---:|" * (3 * len(engines)))
    totals = {e.name: {"b1": [], "b8": []} for e in engines}
    for case, (kind, value) in CASES.items():
        cells = []
        for engine in engines:
            try:
                compile_ms, compiled = timed(lambda: engine.compile(kind, value), repeats)
            except Exception as error:  # noqa: BLE001 - coverage: what an engine refuses
                cells += [f"fails: {str(error).splitlines()[0][:60]}", "-", "-"]
                continue
            b1 = walk(engine, compiled, 1, tokens, seed=1)
            b8 = walk(engine, compiled, 8, tokens, seed=2)
            totals[engine.name]["b1"] += b1.mask_ms
            totals[engine.name]["b8"] += b8.mask_ms
            cells += [f"{compile_ms:.1f}", f"{statistics.median(b1.mask_ms):.3f}",
                      f"{statistics.median(b8.mask_ms):.3f}"]
        print(f"| {case} | " + " | ".join(cells) + " |")
    print()
    for name, series in totals.items():
        print(f"{name}: mask per step over every case, median b1 {statistics.median(series['b1']):.3f} ms "
              f"(p90 {np.percentile(series['b1'], 90):.3f}), b8 {statistics.median(series['b8']):.3f} ms "
              f"(p90 {np.percentile(series['b8'], 90):.3f})")
    print(f"applying the mask to logits: b1 {mask_apply_ms(vocab, 1):.3f} ms, b8 {mask_apply_ms(vocab, 8):.3f} ms")


if __name__ == "__main__":
    main()
