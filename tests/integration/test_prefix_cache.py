"""Prefix caching through the real processes (tiny model): cached_tokens in
responses equal the worker's skipped prefill, sessions stick to the worker
holding their blocks, the KV index agrees with the workers after churn, stats
are consistent, and the Redis-backed index survives a kvcache restart."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from fairserve.v1 import common_pb2, kvindex_pb2, kvindex_pb2_grpc, worker_pb2, worker_pb2_grpc

from fairserve.launcher.stack import Stack
from tests.fixtures.redis_server import running_redis
from tests.integration.conftest import TINY_ENV, start_stack
from tests.integration.helpers import stream_generate

BLOCK_SIZE = int(TINY_ENV["KV_CACHE_BLOCK_SIZE"])
FIRST_ORDINARY_ID = 6     # ids below are the tiny tokenizer's special tokens
VOCAB_SIZE = 384
CHURN_POOL_BLOCKS = 96


# ---- clients ------------------------------------------------------------------------------

class Probe:
    """gRPC views of a running stack: each worker's pool and the KV index."""

    def __init__(self, stack: Stack) -> None:
        self.worker_ids = [f"worker-{index}" for index in range(len(stack.ports.workers))]
        self._channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for port, _ in stack.ports.workers]
        self._workers = [worker_pb2_grpc.WorkerStub(channel) for channel in self._channels]
        self._kv_channel = grpc.insecure_channel(f"127.0.0.1:{stack.ports.kvcache}")
        self._kv = kvindex_pb2_grpc.KvIndexStub(self._kv_channel)

    def worker_stats(self) -> dict[str, worker_pb2.WorkerStats]:
        return {worker_id: stub.Stats(common_pb2.StatsRequest(), timeout=5)
                for worker_id, stub in zip(self.worker_ids, self._workers)}

    def index_stats(self) -> kvindex_pb2.KvIndexStats:
        return self._kv.Stats(common_pb2.StatsRequest(), timeout=5)

    def lookup(self, token_ids: list[int]) -> dict[str, int]:
        reply = self._kv.Lookup(kvindex_pb2.LookupRequest(token_ids=token_ids), timeout=5)
        return {match.worker_id: match.matched_tokens for match in reply.matches}

    def exact_holders(self, token_ids: list[int], cache_salt: str = "") -> set[str]:
        """Workers the index says hold the whole prompt (under `cache_salt`), its partial last
        block included."""
        reply = self._kv.Lookup(kvindex_pb2.LookupRequest(token_ids=token_ids, cache_salt=cache_salt), timeout=5)
        return {match.worker_id for match in reply.matches if match.exact}

    def wait_quiescent(self, timeout_s: float = 15.0) -> dict[str, worker_pb2.WorkerStats]:
        """Waits until no worker runs a sequence, the index has acknowledged every
        worker's block events (publishing lags a step, and equal block counts alone can
        hide an eviction and a store both still unpublished), and it holds, for every
        worker, as many blocks as the worker has cached."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.worker_stats()
            index = dict(self.index_stats().blocks_by_worker)
            idle = all(stats.running_sequences == 0 for stats in workers.values())
            published = all(stats.kv_events_unacknowledged == 0 for stats in workers.values())
            agree = all(index.get(w, 0) == stats.pool.cached_blocks for w, stats in workers.items())
            if idle and published and agree:
                return workers
            assert time.monotonic() < deadline, (
                f"workers never settled: idle={idle} published={published} agree={agree}")
            time.sleep(0.1)

    def close(self) -> None:
        for channel in [*self._channels, self._kv_channel]:
            channel.close()


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    cached_tokens: int


def complete_ids(base_url: str, prompt_ids: list[int], max_tokens: int = 1,
                 session_id: str | None = None) -> Completion:
    """A greedy /v1/completions call on token ids (no tokenizer in the way)."""
    body: dict[str, Any] = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True}
    if session_id is not None:
        body["session_id"] = session_id
    reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    usage = data["usage"]
    return Completion(data["choices"][0]["text"], usage["prompt_tokens"],
                      usage["prompt_tokens_details"]["cached_tokens"])


def random_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in range(length)]


def reusable_tokens(prompt_len: int) -> int:
    """The engine's rule for full blocks (docs/engine/kv-cache.md): whole cached blocks, keeping
    at least the last prompt token to compute for its logits. When all of them are
    cached, the exact-match path may reuse the rest but that last token too."""
    return (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE


def served_by(before: dict[str, worker_pb2.WorkerStats], after: dict[str, worker_pb2.WorkerStats]) -> str:
    """The one worker whose prefix lookups moved between two snapshots."""
    moved = [w for w in after
             if after[w].pool.prefix_query_tokens != before[w].pool.prefix_query_tokens]
    assert len(moved) == 1, f"expected one worker to serve the request, saw {moved}"
    return moved[0]


def start_two_workers(tmp_path: Path, model_dir: Path, extra_env: dict[str, str]) -> Stack:
    """A stack with two workers, returned once the scheduler has registered both
    (the gateway is ready as soon as one is)."""
    stack = start_stack(tmp_path, model_dir, num_workers=2, extra_env=extra_env)
    try:
        stack.wait_workers(2, timeout_s=60)
    except BaseException:
        stack.stop()
        raise
    return stack


@pytest.fixture(scope="module")
def two_worker_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # A small pool (384 tokens a worker) so that the churn test, last, evicts.
    stack = start_two_workers(tmp_path_factory.mktemp("prefix-two"), tiny_model_dir,
                              {"KV_CACHE_NUM_BLOCKS": str(CHURN_POOL_BLOCKS)})
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def probe(two_worker_stack: Stack) -> Iterator[Probe]:
    probe = Probe(two_worker_stack)
    yield probe
    probe.close()


# ---- one prompt, cold then warm -----------------------------------------------------------

def test_repeated_prompt_skips_the_prefill_the_worker_really_skipped(
        two_worker_stack: Stack, probe: Probe, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sentences = " ".join(f"Sentence number {i} talks about the capital of France." for i in range(6))
    # A prompt whose last block is partial, so that the exact-match rule shows.
    prompt = next(text for extra in range(2 * BLOCK_SIZE)
                  if len(tokenizer(text := sentences + " How are you today?" + " ok" * extra)["input_ids"])
                  % BLOCK_SIZE > 1)
    changed = sentences + " Hello world, this last one differs!"
    prompt_len = len(tokenizer(prompt)["input_ids"])

    def run(text: str) -> tuple[list[int], dict[str, Any], dict[str, worker_pb2.WorkerStats]]:
        before = probe.wait_quiescent()
        events = stream_generate(two_worker_stack.url, {"prompt": text, "raw": True, "max_tokens": 6,
                                                        "ignore_eos": True, "temperature": 0})
        after = probe.wait_quiescent()
        worker = served_by(before, after)
        usage = events[-1]["usage"]
        skipped = after[worker].pool.prefix_hit_tokens - before[worker].pool.prefix_hit_tokens
        assert usage["cached_tokens"] == skipped, "usage must report the worker's skipped prefill"
        prefill = after[worker].total_prefill_tokens - before[worker].total_prefill_tokens
        assert prefill == usage["prompt_tokens"] - usage["cached_tokens"]
        return [e["token_id"] for e in events if "token_id" in e], usage, after

    cold_tokens, cold, _ = run(prompt)
    assert cold["prompt_tokens"] == prompt_len and cold["cached_tokens"] == 0

    warm_tokens, warm, _ = run(prompt)
    assert warm["cached_tokens"] == prompt_len, "an identical prompt reuses its K/V and last logits"
    assert warm_tokens == cold_tokens, "greedy tokens must not depend on the prefix cache"

    changed_len = len(tokenizer(changed)["input_ids"])
    common = next(i for i, (a, b) in enumerate(zip(tokenizer(prompt)["input_ids"],
                                                   tokenizer(changed)["input_ids"])) if a != b)
    _, other, _ = run(changed)
    assert other["prompt_tokens"] == changed_len
    # Whole shared blocks, plus the shared start of the block where the prompts part.
    assert 0 < common // BLOCK_SIZE * BLOCK_SIZE <= other["cached_tokens"] <= common


@pytest.mark.parametrize("tail", range(BLOCK_SIZE))
def test_identical_prompt_skips_its_whole_prefill(two_worker_stack: Stack, probe: Probe, tail: int) -> None:
    """Whatever fills the last block (nothing included), an identical prompt reuses the
    K/V of every token and the kept logits of its last one, and samples what the cold run did."""
    prompt = random_ids(random.Random(tail), 4 * BLOCK_SIZE + tail)
    first = complete_ids(two_worker_stack.url, prompt, max_tokens=3)
    probe.wait_quiescent()
    again = complete_ids(two_worker_stack.url, prompt, max_tokens=3)
    assert again.cached_tokens == len(prompt)
    assert again.text == first.text
    probe.wait_quiescent()


def test_n_choices_prefill_their_shared_prompt_once(two_worker_stack: Stack, probe: Probe) -> None:
    """n > 1: the first choice prefills the prompt; the others go to the same worker,
    wait for its blocks and compute only what follows the last full block."""
    prompt = random_ids(random.Random(77), 40 * BLOCK_SIZE + 3)   # past PREFIX_WAIT_MIN_TOKENS (64)
    before = probe.wait_quiescent()
    reply = httpx.post(f"{two_worker_stack.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 4, "n": 4, "temperature": 1.0, "seed": 5, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 4
    after = probe.wait_quiescent()
    worker = served_by(before, after)
    hits = after[worker].pool.prefix_hit_tokens - before[worker].pool.prefix_hit_tokens
    prefill = after[worker].total_prefill_tokens - before[worker].total_prefill_tokens
    assert hits >= 3 * reusable_tokens(len(prompt)), (hits, prefill)
    assert prefill <= len(prompt) + 3 * (len(prompt) - reusable_tokens(len(prompt))), (hits, prefill)


# ---- sessions ----------------------------------------------------------------------------

def test_second_turn_reuses_first_turns_prompt_and_generated_tokens(
        two_worker_stack: Stack, probe: Probe, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    turn1 = "Once upon a time there was a small model. How are you today? Tell me more."
    turn1_ids = list(tokenizer(turn1)["input_ids"])
    events = stream_generate(two_worker_stack.url, {
        "prompt": turn1, "raw": True, "max_tokens": 13, "ignore_eos": True, "temperature": 0,
        "session_id": "chat-1"})
    output_ids = [e["token_id"] for e in events if "token_id" in e]
    assert len(output_ids) == 13
    probe.wait_quiescent()

    turn2_ids = turn1_ids + output_ids + random_ids(random.Random(1), 9)
    second = complete_ids(two_worker_stack.url, turn2_ids, session_id="chat-1")
    # KV exists for everything turn 1 computed: its prompt and all but its last sampled token.
    computed_by_turn1 = len(turn1_ids) + len(output_ids) - 1
    assert computed_by_turn1 > len(turn1_ids) + BLOCK_SIZE
    assert computed_by_turn1 // BLOCK_SIZE * BLOCK_SIZE <= second.cached_tokens <= computed_by_turn1


def test_sessions_stick_to_one_worker_and_reuse_their_prefix(two_worker_stack: Stack, probe: Probe) -> None:
    rng = random.Random(42)
    prefix_len = 12 * BLOCK_SIZE
    prefixes = {f"session-{n}": random_ids(rng, prefix_len) for n in range(8)}

    def ask(session: str) -> Completion:
        return complete_ids(two_worker_stack.url, prefixes[session] + random_ids(rng, 5),
                            max_tokens=2, session_id=session)

    # First turns together, so that routing by load spreads them.
    with ThreadPoolExecutor(max_workers=8) as pool:
        firsts = list(pool.map(ask, prefixes))
    assert all(first.cached_tokens == 0 for first in firsts)
    probe.wait_quiescent()
    home = {}
    for session, prefix in prefixes.items():
        holders = probe.lookup(prefix)
        assert len(holders) == 1 and list(holders.values())[0] == prefix_len, holders
        home[session] = next(iter(holders))
    assert set(home.values()) == set(probe.worker_ids), f"sessions not spread over workers: {home}"

    repeated = served = 0
    for _ in range(2):
        for session in prefixes:
            before = probe.worker_stats()
            answer = ask(session)
            after = probe.wait_quiescent()
            assert served_by(before, after) == home[session], f"{session} left its worker"
            repeated += prefix_len
            served += min(answer.cached_tokens, prefix_len)
    assert served / repeated >= 0.9


# ---- stats -------------------------------------------------------------------------------

def test_stats_through_grpc_and_gateway_are_consistent(two_worker_stack: Stack, probe: Probe) -> None:
    prompt = random_ids(random.Random(3), 6 * BLOCK_SIZE + 2)
    complete_ids(two_worker_stack.url, prompt)
    probe.wait_quiescent()
    complete_ids(two_worker_stack.url, prompt)
    workers = probe.wait_quiescent()
    index = probe.index_stats()
    page = httpx.get(f"{two_worker_stack.url}/stats", timeout=10).json()

    kv = page["kvcache"]
    assert kv["lookups"] >= 2 and 1 <= kv["hits"] <= kv["lookups"]
    assert 0 < kv["hit_tokens"] <= kv["lookup_tokens"]
    assert kv["hit_rate"] == pytest.approx(kv["hit_tokens"] / kv["lookup_tokens"])
    assert kv["lookups"] >= index.lookups and kv["hits"] >= index.hits
    assert kv["blocks_by_worker"] == {w: n for w, n in index.blocks_by_worker.items()}
    assert kv["backend"] == "memory"

    by_id = {entry["worker_id"]: entry for entry in page["scheduler"]["workers"]}
    assert set(by_id) == set(workers)
    for worker_id, stats in workers.items():
        pool = stats.pool
        assert pool.free_blocks + pool.cached_blocks + pool.used_blocks == pool.total_blocks
        assert pool.prefix_hit_tokens <= pool.prefix_query_tokens
        entry = by_id[worker_id]
        assert (entry["free_blocks"], entry["cached_blocks"], entry["used_blocks"], entry["total_blocks"],
                entry["evictions"]) == (pool.free_blocks, pool.cached_blocks, pool.used_blocks,
                                        pool.total_blocks, pool.evictions)
    assert sum(s.pool.prefix_hit_tokens for s in workers.values()) >= reusable_tokens(len(prompt))


# ---- churn with evictions ----------------------------------------------------------------

def test_index_agrees_with_workers_after_churn(two_worker_stack: Stack, probe: Probe) -> None:
    rng = random.Random(5)
    shared = [random_ids(rng, rng.randrange(4, 60)) for _ in range(5)]
    prompts = [rng.choice(shared) + random_ids(rng, rng.randrange(1, 40)) for _ in range(48)]
    lengths = [rng.randrange(1, 6) for _ in prompts]
    evictions_before = sum(s.pool.evictions for s in probe.worker_stats().values())
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda ids, n: complete_ids(two_worker_stack.url, ids, max_tokens=n), prompts, lengths))
    workers = probe.wait_quiescent()
    index = probe.index_stats()
    assert sum(s.pool.evictions for s in workers.values()) > evictions_before, "the churn must evict"
    assert all(s.running_sequences == 0 for s in workers.values())
    assert {w: n for w, n in index.blocks_by_worker.items() if n} == {
        w: s.pool.cached_blocks for w, s in workers.items() if s.pool.cached_blocks}
    # Workers publish the partial last block of whole prompts they still hold: some survive
    # the churn, and every such claim holds: the prompt goes to a worker the index names,
    # which skips all of its prefill but (at most) the last token.
    exact = {tuple(ids): holders for ids in prompts if len(ids) % BLOCK_SIZE
             and (holders := probe.exact_holders(ids))}
    assert exact, "the churn must leave some prompts' partial blocks published"
    for ids in rng.sample(sorted(exact), min(4, len(exact))):
        before = probe.worker_stats()
        again = complete_ids(two_worker_stack.url, list(ids))
        after = probe.wait_quiescent()
        assert served_by(before, after) in exact[ids]
        assert again.cached_tokens >= len(ids) - 1
    # The index's claims hold: a prompt routed by them skips exactly the claimed prefill.
    for prompt in rng.sample(prompts, 6):
        claimed = max(probe.lookup(prompt).values(), default=0)
        again = complete_ids(two_worker_stack.url, prompt)
        # The index may not know every partial tail the worker holds (only whole prompts').
        exact_match = claimed >= reusable_tokens(len(prompt)) and again.cached_tokens >= len(prompt) - 1
        assert (min(claimed, reusable_tokens(len(prompt))) <= again.cached_tokens <= len(prompt) - 1
                or exact_match)
        probe.wait_quiescent()


# ---- Redis-backed index ------------------------------------------------------------------

def test_redis_index_routes_and_survives_a_kvcache_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    with running_redis(redis_dir) as redis_url:
        stack = start_two_workers(tmp_path, tiny_model_dir,
                                  {"KV_INDEX_BACKEND": "redis", "REDIS_URL": redis_url})
        probe = Probe(stack)
        try:
            rng = random.Random(11)
            prefixes = [random_ids(rng, 12 * BLOCK_SIZE) for _ in range(4)]
            with ThreadPoolExecutor(max_workers=4) as pool:   # together, so that load spreads them
                list(pool.map(lambda ids: complete_ids(stack.url, ids + random_ids(rng, 3), max_tokens=8),
                              prefixes))
            probe.wait_quiescent()
            holders = [probe.lookup(prefix) for prefix in prefixes]
            assert all(list(held.values()) == [12 * BLOCK_SIZE] for held in holders), holders
            assert {next(iter(held)) for held in holders} == set(probe.worker_ids)
            before = probe.index_stats()
            assert before.backend == "redis"

            stack.restart_kvcache()
            after = probe.index_stats()
            assert dict(after.blocks_by_worker) == dict(before.blocks_by_worker)
            assert [probe.lookup(prefix) for prefix in prefixes] == holders

            # Routing goes by the restarted index: each holder serves its prefix from cache.
            for prefix, held in zip(prefixes, holders):
                workers_before = probe.worker_stats()
                answer = complete_ids(stack.url, prefix + random_ids(rng, 3))
                workers_after = probe.wait_quiescent()
                assert served_by(workers_before, workers_after) == next(iter(held))
                assert answer.cached_tokens == len(prefix)
            assert probe.index_stats().hits >= len(prefixes)
        finally:
            probe.close()
            stack.stop()
