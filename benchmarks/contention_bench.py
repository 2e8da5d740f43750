"""Batch-1 decode on shared cores: the worker's engine (default model) generating one stream,
idle, beside a busy process on the same cores, and under a cgroup CPU quota of one CPU (as a
Kubernetes CPU limit of 1 sets it), each with the thread policy before CPU_THREAD_POLICY
(all the allowed CPUs, fixed) and with the defaults now (adaptive, within the quota).

    python -m benchmarks.contention_bench              # ~4 min, root for the quota rows
    python -m benchmarks.contention_bench --quick      # tiny model: checks the script

Each run is a process of its own (the quota applies to its cgroup from its first
instruction); the policies alternate within each condition over --rounds rounds; TPOT is the
mean over the generation's steps (the adaptation's own steps included), medians of the rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path

POLICIES = ("before", "now")
CONDITIONS = ("idle", "busy process", "quota 1 CPU")


def child(policy: str, model_dir: str, steps: int) -> dict:
    """One generation in this process: mean and p50 TPOT (ms), the threads at the end."""
    import torch

    from benchmarks.engine_bench import EngineRunner, make_prompts
    from common.step import StepBatch, WorkItem
    from services.worker.engine.config import EngineConfig
    from services.worker.wiring import build_engine, thread_pacer, with_cpu_threads

    config = EngineConfig(model_dir=model_dir, num_blocks=64)
    if policy == "before":
        config = dataclasses.replace(config, torch_threads=len(os.sched_getaffinity(0)))  # the old default
    else:
        config = with_cpu_threads(config)
    engine = build_engine(config)
    engine.wait_for_screen(120)
    pacer = thread_pacer("adaptive", engine) if policy == "now" else None
    runner = EngineRunner(engine, 2048)
    vocab = int(engine.model_config.vocab_size)
    runner.decode_tokens_per_s(make_prompts(1, 32, vocab, seed=1), 4)           # warm
    seq_ids = runner._ids(1)
    runner._serve(seq_ids, make_prompts(1, 64, vocab, seed=2), new_tokens=1, free=False)
    work = StepBatch(work=[WorkItem(seq_ids[0], 1)])
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step(work)
        if pacer is not None:
            pacer.after_step(1, time.perf_counter() - started)
        times.append(time.perf_counter() - started)
    return {"mean_ms": 1000 * statistics.fmean(times), "p50_ms": 1000 * statistics.median(times),
            "threads_end": torch.get_num_threads(), "changes": pacer.changes if pacer else 0}


@contextmanager
def busy_process() -> Iterator[None]:
    """A CPU-bound process on the same cores, at normal priority."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        process.kill()
        process.wait()


def quota_cgroup(cpus: float) -> tuple[list[str], Path] | None:
    """A cgroup with a CPU quota of `cpus` (v2, else v1's cpu controller): the command prefix
    that starts a process inside it, and its directory; None where it cannot be made."""
    name = f"fairserve-bench-{uuid.uuid4().hex[:8]}"
    period = 100_000
    root = Path("/sys/fs/cgroup")
    for directory, files, procs in ((root / name, {"cpu.max": f"{int(cpus * period)} {period}"}, "cgroup.procs"),
                                    (root / "cpu" / name, {"cpu.cfs_period_us": str(period),
                                                           "cpu.cfs_quota_us": str(int(cpus * period))}, "tasks")):
        # v2 where the root is a cgroup2 mount (cgroup.controllers), v1 where a cpu controller is
        if not (directory.parent / ("cgroup.controllers" if directory.parent == root else "cpu.cfs_quota_us")).is_file():
            continue
        try:
            directory.mkdir()
            for file, value in files.items():
                (directory / file).write_text(value)
        except OSError:
            try:
                directory.rmdir()
            except OSError:
                pass
            continue
        return ["sh", "-c", f'echo $$ > {directory / procs} && exec "$@"', "sh"], directory
    return None


def run_child(policy: str, model_dir: str, steps: int, prefix: list[str]) -> dict:
    command = [*prefix, sys.executable, "-m", "benchmarks.contention_bench", "--child", policy,
               "--model-dir", model_dir, "--steps", str(steps)]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default="")
    parser.add_argument("--steps", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.model_dir, args.steps)))
        return 0
    from benchmarks.machine import cpu_name
    from common.model_store import default_cache_dir, default_model_dir

    scratch = None
    model_dir = args.model_dir
    if args.quick:
        import tempfile

        from tests.fixtures.tiny_model import save_tiny_model
        scratch = tempfile.TemporaryDirectory()
        model_dir = str(save_tiny_model(Path(scratch.name) / "tiny"))
        args.steps, args.rounds = 16, 1
    model_dir = model_dir or str(default_model_dir(default_cache_dir()))
    cgroup = quota_cgroup(1.0)
    results: dict[str, dict[str, list[dict]]] = {c: {p: [] for p in POLICIES} for c in CONDITIONS}
    print(f"# {cpu_name()}, {len(os.sched_getaffinity(0))} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
          flush=True)
    try:
        for condition in CONDITIONS:
            if condition == "quota 1 CPU" and cgroup is None:
                print("quota 1 CPU: skipped (no cgroup could be made: needs root and a cpu controller)")
                continue
            prefix = cgroup[0] if condition == "quota 1 CPU" and cgroup else []
            for round_index in range(args.rounds):
                for policy in (POLICIES if round_index % 2 == 0 else POLICIES[::-1]):
                    if condition == "busy process":
                        with busy_process():
                            result = run_child(policy, model_dir, args.steps, prefix)
                    else:
                        result = run_child(policy, model_dir, args.steps, prefix)
                    results[condition][policy].append(result)
                    print(f"{condition} {policy} round {round_index + 1}: {json.dumps(result)}", flush=True)
    finally:
        if cgroup is not None:
            cgroup[1].rmdir()
        if scratch is not None:
            scratch.cleanup()
    print(render(results))
    return 0


def render(results: dict[str, dict[str, list[dict]]]) -> str:
    idle = {p: statistics.median(r["mean_ms"] for r in runs) for p, runs in results["idle"].items() if runs}
    lines = ["| condition | policy | TPOT mean ms (median of rounds) | vs idle, same policy | threads at the end | rounds |",
             "|---|---|---:|---:|---|---|"]
    for condition, by_policy in results.items():
        for policy, runs in by_policy.items():
            if not runs:
                continue
            tpot = statistics.median(r["mean_ms"] for r in runs)
            ratio = f"{tpot / idle[policy]:.2f}x" if idle.get(policy) else "—"
            lines.append(f"| {condition} | {policy} | {tpot:.1f} | {ratio} | "
                         f"{'/'.join(str(r['threads_end']) for r in runs)} | "
                         f"{' / '.join(format(r['mean_ms'], '.1f') for r in runs)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
