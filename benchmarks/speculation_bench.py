"""N-gram speculative decoding in the engine, off against on, side by side in one run.

The same engine decodes the same kind of prompts with plain decodes and with
decodes that verify up to N drafted tokens, alternating, each measurement on
prompts of its own (so the prefix cache helps neither). Two prompt sets: the
engine benchmark's random token ids, and the load simulator's built-in texts
(questions and a long manual), closer to what users send. Greedy decoding; the
tests check that speculation leaves the tokens unchanged.

    python -m benchmarks.speculation_bench                 # default model, ~4 min
    python -m benchmarks.speculation_bench --quick         # tiny random model: checks the script
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from benchmarks.engine_bench import make_prompts
from benchmarks.machine import cpu_name
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from loadsim import default_texts
from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.wiring import build_engine


def random_prompts(count: int, vocab_size: int, seed: int) -> list[list[int]]:
    """The engine benchmark's 256-token prompts (short ones from a small vocabulary on a tiny model)."""
    if vocab_size > 1000:
        return make_prompts(count, 256, vocab_size, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    return [[2] + torch.randint(3, vocab_size, (31,), generator=generator).tolist() for _ in range(count)]


def text_prompts(tokenizer, count: int, salt: int) -> list[list[int]]:
    """Prompts from the load simulator's texts, each made unique by a leading tag."""
    texts = ([f"{default_texts.ASSISTANT_SYSTEM}\nQuestion: {q}\nAnswer:" for q in default_texts.SHORT_QUESTIONS]
             + [f"{default_texts.MANUAL_SYSTEM}\nQuestion: What does error E{i % 4 + 1} mean?\nAnswer:"
                for i in range(4)])
    return [tokenizer(f"[{salt}.{i}] {texts[(salt + i) % len(texts)]}").input_ids for i in range(count)]


def decode_run(engine: Engine, prompts: list[list[int]], new_tokens: int, draft_tokens: int,
               tag: str) -> tuple[float, list[list[int]], int, int]:
    """(output tokens/s over the decode steps, outputs, drafted, accepted)."""
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    out = engine.step(StepBatch(new_sequences=[NewSequence(i, p) for i, p in zip(ids, prompts)],
                                work=[WorkItem(i, 1 << 20) for i in ids]))
    outputs = {r.seq_id: list(r.token_ids) for r in out.results}
    drafted = accepted = 0
    started = time.perf_counter()
    while True:
        live = [i for i in ids if len(outputs[i]) < new_tokens]
        if not live:
            break
        work = [WorkItem(i, 1, max(0, min(draft_tokens, new_tokens - len(outputs[i]) - 1))) for i in live]
        out = engine.step(StepBatch(work=work))
        drafted += out.draft_tokens
        accepted += out.accepted_tokens
        for result in out.results:
            outputs[result.seq_id].extend(result.token_ids)
    seconds = time.perf_counter() - started
    engine.step(StepBatch(free_seq_ids=ids))
    decoded = sum(min(len(outputs[i]), new_tokens) - 1 for i in ids)
    return decoded / seconds, [outputs[i][:new_tokens] for i in ids], drafted, accepted


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model, small sizes")
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--batches", default="1,4,8", help="concurrent sequences per measurement")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        model_dir, new_tokens, batches = "", 8, [1, 2]
    else:
        model_dir = str(default_model_dir(default_cache_dir()))
        if not is_prepared(default_model_dir(default_cache_dir())):
            raise SystemExit("default model not prepared: run `make prepare-model` first")
        new_tokens = args.new_tokens
    engine, tokenizer = _engine_and_tokenizer(model_dir, args.quick)
    rows = []
    salt = 0
    for name in ("random ids", "built-in texts"):
        for batch in batches:
            salt += 1
            rates = {}
            outputs = {}
            counts = (0, 0)
            for draft in (0, args.speculative_tokens):
                salt += 1
                prompts = (random_prompts(batch, engine.info.vocab_size, salt) if name == "random ids"
                           else text_prompts(tokenizer, batch, salt))
                rate, outs, drafted, accepted = decode_run(engine, prompts, new_tokens, draft, f"s{salt}-")
                rates[draft], outputs[draft] = rate, outs
                if draft:
                    counts = (drafted, accepted)
            drafted, accepted = counts
            rows.append((name, batch, rates[0], rates[args.speculative_tokens],
                         accepted / drafted if drafted else 0.0))
    print(f"Speculative decoding (n-gram, up to {args.speculative_tokens} drafts per decode), "
          f"{'tiny random model' if args.quick else model_dir}, {cpu_name()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, greedy, {new_tokens} new tokens.")
    print()
    print("| prompts | batch | decode tok/s, plain | with speculation | speedup | drafts kept |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, batch, plain, spec, kept in rows:
        print(f"| {name} | {batch} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x | {kept:.0%} |")


def _engine_and_tokenizer(model_dir: str, quick: bool):
    if quick:
        from tests.fixtures.tiny_model import build_model, gemma3_config

        model = build_model(gemma3_config())
        engine = build_engine(EngineConfig(model_dir="", num_blocks=512, block_size=4, model_key="tiny"), model=model)

        def tokenizer(text: str):
            ids = [2] + [10 + ord(c) % 300 for c in text[:64]]
            return type("Encoded", (), {"input_ids": ids})()
        return engine, tokenizer
    from transformers import AutoTokenizer

    engine = build_engine(EngineConfig(model_dir=model_dir, model_key=os.path.basename(model_dir)))
    engine.wait_for_screen()     # the LM head screen is built in the background; measure with it
    return engine, AutoTokenizer.from_pretrained(model_dir)


if __name__ == "__main__":
    main()
