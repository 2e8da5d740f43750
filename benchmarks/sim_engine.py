"""A simulated engine for the scale benchmark: the worker's step contract (common/step.py) kept
exactly (frees, new sequences, chunked prefill, one sampled token when a sequence's known tokens
are all computed, the pool's blocks and its errors), with the forward replaced by a model of its
time. Serving it with the real WorkerService (sim_workers.py) gives a worker that speaks the real
protocol at the cost of a GPU worker's step, with no model and almost no CPU.

The default cost model is an H200 serving an 8B model (docs/scaling.md): a decode step of ~20 ms
for up to 64 sequences, prefill at ~15k tokens/s. `StepCosts.from_json` takes measured costs
instead (e.g. the real engine's, from benchmarks.engine_bench)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from benchmarks.sim_prefix_cache import SimPrefixCache
from common.block_hash import extend_chain, salted_key
from common.step import NewSequence, PoolStats, SeqResult, StepBatch, StepError, StepOutput
from services.worker.engine.types import BlockEvent, EngineInfo, StaleEpoch

SIM_VOCAB = 32000
SIM_EOS = 2


@dataclass(frozen=True)
class StepCosts:
    """A step's modelled time: `decode_ms` for each `decode_batch` decodes (or part of it),
    plus prefill tokens at `prefill_tok_s`."""

    decode_ms: float = 20.0
    decode_batch: int = 64
    prefill_tok_s: float = 15000.0

    def step_s(self, decodes: int, prefill_tokens: int) -> float:
        decode = math.ceil(decodes / self.decode_batch) * self.decode_ms / 1000.0
        return decode + prefill_tokens / self.prefill_tok_s

    def scaled(self, factor: float) -> StepCosts:
        """Every step `factor` times as long (a slower simulated device)."""
        return StepCosts(self.decode_ms * factor, self.decode_batch, self.prefill_tok_s / factor)

    @staticmethod
    def from_json(path: str | Path) -> StepCosts:
        """{"decode_ms": .., "decode_batch": .., "prefill_tok_s": ..}, e.g. measured on the real engine."""
        data = json.loads(Path(path).read_text())
        return StepCosts(float(data["decode_ms"]), int(data["decode_batch"]), float(data["prefill_tok_s"]))


@dataclass
class _Seq:
    tokens: list[int]   # prompt and output tokens
    key: str            # the block hashes' key (model key and cache salt)
    chain: list[int]    # hashes of its computed full blocks, held in the prefix cache
    computed: int = 0
    cached: int = 0     # prompt tokens taken from the cache, reported with its first result

    @property
    def known(self) -> int:
        return len(self.tokens)


def sim_token(position: int) -> int:
    """A deterministic token for a position (never EOS: the benchmark's requests ignore it anyway)."""
    return 3 + (position * 7919) % (SIM_VOCAB - 3)


class SimEngine:
    """What WorkerService calls on an engine, with no forward: `step` returns at once and leaves
    its modelled duration in `pending_s` for the engine thread to wait out (sim_workers.py)."""

    def __init__(self, costs: StepCosts = StepCosts(), num_blocks: int = 48000, block_size: int = 16,
                 max_model_len: int = 8192, model_key: str = "") -> None:
        self.costs = costs
        self.model_key = model_key
        self.cache = SimPrefixCache(block_size)
        self.block_size = block_size
        self.info = EngineInfo(model_name="simulated", block_size=block_size, num_blocks=num_blocks,
                               device="simulated", dtype="bfloat16", max_model_len=max_model_len,
                               eos_token_ids=[SIM_EOS], vocab_size=SIM_VOCAB)
        self.epoch = 0
        self.runs_decode_steps = True   # WorkerService leaves WorkItem.decode_steps to step()
        self.pending_s = 0.0
        self.last_step_id = 0   # of the last step run
        self._seqs: dict[str, _Seq] = {}
        self._used_blocks = 0
        self._hit_tokens = 0
        self._query_tokens = 0

    def adopt_epoch(self, epoch: int) -> int:
        if epoch < self.epoch:
            raise StaleEpoch(f"step of epoch {epoch}, the worker serves epoch {self.epoch}")
        if epoch == self.epoch:
            return 0
        self.epoch, freed = epoch, len(self._seqs)
        for seq in self._seqs.values():
            self.cache.release(seq.chain)
        self._seqs.clear()
        self._used_blocks = 0
        return freed

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def step(self, batch: StepBatch) -> StepOutput:
        self.last_step_id = batch.step_id
        for seq_id in batch.free_seq_ids:
            seq = self._seqs.pop(seq_id, None)
            if seq is not None:
                self._used_blocks -= self._blocks(seq.computed)
                self.cache.release(seq.chain)
        for new in batch.new_sequences:
            self._seqs[new.seq_id] = self._start(new)
        results, decodes, prefill, seen = [], 0, 0, set()
        for item in batch.work:
            result, computed = self._work(item.seq_id, item.num_tokens, seen)
            results.append(result)
            if computed == 1 and result.sampled:
                decodes += 1
            else:
                prefill += computed
        step_s = self.costs.step_s(decodes, prefill)
        if self.runs_decode_steps:
            step_s += self._more_runs(batch, results)
        self.pending_s += step_s
        self.cache.evict_to(self.info.num_blocks - self._used_blocks)
        return StepOutput(results=tuple(results), pool=self.pool_stats(), forward_ms=step_s * 1000.0,
                          step_id=batch.step_id, batch_tokens=decodes + prefill, prompt_tokens=prefill)

    def _more_runs(self, batch: StepBatch, results: list[SeqResult]) -> float:
        """The decodes' further runs (WorkItem.decode_steps), as a device running them back to
        back would: each sequence's tokens added to its result, and the runs' modelled time
        returned. The worker's own loop (services/worker/decode_steps.py) would do the same with
        a Python pass per run; here those passes would cost the process that hosts every simulated
        worker, which a real worker's own cores pay. The runs are not interrupted by an arrival."""
        going = [index for index, item in enumerate(batch.work)
                 if item.decode_steps > 1 and results[index].sampled and results[index].token_id != SIM_EOS]
        more: dict[int, list[int]] = {index: [] for index in going}
        seconds, run = self._all_runs(batch, going, more), 1
        if seconds is not None:
            going = []
        seconds = seconds or 0.0
        while going:
            going = [index for index in going if batch.work[index].decode_steps > run
                     and self._decode_again(self._seqs[batch.work[index].seq_id], more[index])]
            seconds += self.costs.step_s(len(going), 0) if going else 0.0
            run += 1
        for index, tokens in more.items():
            if tokens:      # the result was made in this step: filled in place (SeqResult is mutable)
                result = results[index]
                result.more_token_ids += tuple(tokens)
                result.num_computed_tokens = self._seqs[result.seq_id].computed
        return seconds

    def _all_runs(self, batch: StepBatch, going: list[int], more: dict[int, list[int]]) -> float | None:
        """Every run at once, when the pool holds them all, and their modelled time (else None and
        nothing done; the runs then go one at a time, each sequence taking blocks while they last)."""
        runs = {index: batch.work[index].decode_steps - 1 for index in going}
        seqs = {index: self._seqs[batch.work[index].seq_id] for index in going}
        grow = sum(self._blocks(seqs[i].computed + runs[i] + 1) - self._blocks(seqs[i].computed) for i in going)
        if not going or self._used_blocks + grow > self.info.num_blocks:
            return None
        for index in going:
            seq, count = seqs[index], runs[index]
            self._used_blocks += self._blocks(seq.computed + count) - self._blocks(seq.computed)
            seq.computed += count
            tokens = [sim_token(position) for position in range(seq.known, seq.known + count)]
            seq.tokens.extend(tokens)
            more[index].extend(tokens)
            self._cache_computed(seq)
        return self._runs_s(sorted(runs.values()))

    def _runs_s(self, runs: list[int]) -> float:
        """The modelled time of decode runs, `runs` (ascending) being each sequence's count: the
        k-th run decodes the sequences with at least k."""
        seconds, done = 0.0, 0
        for run in range(1, runs[-1] + 1):
            while runs[done] < run:
                done += 1
            seconds += self.costs.step_s(len(runs) - done, 0)
        return seconds

    def _decode_again(self, seq: _Seq, tokens: list[int]) -> bool:
        """One more decode of a sequence whose last token was just sampled; False when the pool
        has no block for it."""
        if self._blocks(seq.computed + 2) - self._blocks(seq.computed) + self._used_blocks > self.info.num_blocks:
            return False
        self._used_blocks += self._blocks(seq.computed + 1) - self._blocks(seq.computed)
        seq.computed += 1
        self._cache_computed(seq)
        token = sim_token(seq.known)
        seq.tokens.append(token)
        tokens.append(token)
        return True

    def _start(self, new: NewSequence) -> _Seq:
        """A new sequence from the longest cached prefix of its tokens' full blocks, short of
        its last token (that one is computed, to be sampled from)."""
        tokens = [*new.prompt_token_ids, *new.output_token_ids]
        key = salted_key(self.model_key, new.cache_salt)
        prompt_chain = self.cache.prompt_chain(tokens[:len(tokens) - 1], key)
        chain = prompt_chain[:self.cache.cached_blocks(prompt_chain)]
        self.cache.hold(chain)
        computed = len(chain) * self.block_size
        self._used_blocks += self._blocks(computed)
        self._hit_tokens += computed
        self._query_tokens += len(new.prompt_token_ids)
        return _Seq(tokens, key, chain, computed, computed)

    def _work(self, seq_id: str, num_tokens: int, seen: set[str]) -> tuple[SeqResult, int]:
        seq = self._seqs.get(seq_id)
        error = (StepError.UNKNOWN_SEQUENCE if seq is None else StepError.DUPLICATE_WORK if seq_id in seen
                 else StepError.INVALID_NUM_TOKENS if num_tokens <= 0
                 else StepError.NOTHING_TO_COMPUTE if seq.computed >= seq.known
                 else StepError.EXCEEDS_MAX_MODEL_LEN if seq.known >= self.info.max_model_len else None)
        seen.add(seq_id)
        if error is not None or seq is None:
            return SeqResult(seq_id=seq_id, error=error or StepError.UNKNOWN_SEQUENCE), 0
        count = min(num_tokens, seq.known - seq.computed)
        grow = self._blocks(seq.computed + count + 1) - self._blocks(seq.computed)
        if self._used_blocks + grow > self.info.num_blocks:
            return SeqResult(seq_id=seq_id, num_computed_tokens=seq.computed, error=StepError.OUT_OF_BLOCKS), 0
        self._used_blocks += self._blocks(seq.computed + count) - self._blocks(seq.computed)
        seq.computed += count
        self._cache_computed(seq)
        cached, seq.cached = seq.cached, 0
        if seq.computed < seq.known:
            return SeqResult(seq_id=seq_id, num_computed_tokens=seq.computed, num_cached_tokens=cached), count
        token = sim_token(seq.known)
        seq.tokens.append(token)
        return SeqResult(seq_id=seq_id, num_computed_tokens=seq.computed, num_cached_tokens=cached,
                         sampled=True, token_id=token), count

    def _cache_computed(self, seq: _Seq) -> None:
        """The sequence's newly computed full blocks into the prefix cache (and its events)."""
        start = len(seq.chain)
        if seq.computed // self.block_size > start:
            extend_chain(seq.chain, seq.tokens[:seq.computed], self.block_size, seq.key)
            self.cache.store(seq.chain, start)

    def drain_events(self) -> list[BlockEvent]:
        return self.cache.drain_events()

    def running_sequences(self) -> int:
        return len(self._seqs)

    def pool_stats(self) -> PoolStats:
        total, cached = self.info.num_blocks, len(self.cache) - self.cache.held_blocks
        return PoolStats(total_blocks=total, free_blocks=total - self._used_blocks - cached, cached_blocks=cached,
                         used_blocks=self._used_blocks, evictions=self.cache.evictions,
                         prefix_hit_tokens=self._hit_tokens, prefix_query_tokens=self._query_tokens)

    def snapshot_chains(self) -> list[tuple[int, list[int]]]:
        return self.cache.snapshot_chains()

    def snapshot_partials(self) -> list:
        return []
