"""Multi-LoRA serving end to end, fairserve against vLLM's CPU LoRA on the same adapters: W1
requests (fresh ~274-token prompts, 64 greedy tokens, streaming) through each server's OpenAI
API, every request naming one of N random r=8 adapters (q_proj, v_proj; PEFT directories written
here), N = 1, 4, 16, in turn, against the base model alone, at concurrency 8 and 32.

Each system is started once with all the adapters (fairserve: LORA_MODULES and MAX_LORAS;
vLLM: --enable-lora --lora-modules --max-loras --max-lora-rank, configured for this CPU as the
head-to-head configures it, systems.py), then the configurations run in rounds, their order
rotating, on prompts of their own each time; each figure is the median round, and each system's
mixed-adapter throughput is quoted against its own base-only throughput measured in the same
rounds.

    python -m benchmarks.lora_serving                          # fairserve and vLLM, default model
    python -m benchmarks.lora_serving --systems fairserve --quick   # tiny model: checks the script
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.head_to_head import peers
from benchmarks.head_to_head.sweep import Driver, Plan, PointRun, warm_up
from benchmarks.head_to_head.systems import LAUNCHERS, LaunchConfig, Served
from benchmarks.head_to_head.workload import unique_requests
from benchmarks.lora_bench import RANK, TARGETS, write_adapters
from benchmarks.machine import cpu_name
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from loadsim.stats import summarize
from loadsim.transport import OK
from loadsim.users import PlannedRequest

SYSTEMS = ("fairserve", "vllm")


class AdapterDriver(Driver):
    """The head-to-head's driver, each request naming the next of `models` in turn."""

    def __init__(self, system: str, served: Served, plan: Plan, models: list[str]) -> None:
        super().__init__(system, served, plan)
        self._models = itertools.cycle(models)

    def _planned(self, prompt: str, max_tokens: int, name: str) -> PlannedRequest:
        planned = super()._planned(prompt, max_tokens, name)
        return replace(planned, body={**planned.body, "model": next(self._models)})


def projection_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Every layer's q_proj and v_proj, `module name -> (in, out)`, from the model's config."""
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    hidden, head_dim = config["hidden_size"], config.get("head_dim") or \
        config["hidden_size"] // config["num_attention_heads"]
    shapes = {}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.self_attn"
        shapes[f"{prefix}.q_proj"] = (hidden, config["num_attention_heads"] * head_dim)
        shapes[f"{prefix}.v_proj"] = (hidden, config["num_key_value_heads"] * head_dim)
    assert all(name.endswith(TARGETS) for name in shapes)
    return shapes


def adapter_settings(system: str, adapters: dict[str, Path]) -> tuple[dict[str, str], tuple[str, ...]]:
    """What `system` is started with to serve every adapter resident: environment, arguments."""
    modules = [f"{name}={path}" for name, path in adapters.items()]
    if system == "fairserve":
        return {"LORA_MODULES": ",".join(modules), "MAX_LORAS": str(len(adapters)),
                "MAX_LORA_RANK": str(RANK)}, ()
    return {}, ("--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(RANK),
                "--lora-modules", *modules)


async def run_point(driver: AdapterDriver, concurrency: int, seed: int, plan: Plan) -> float:
    """One closed-loop point on fresh prompts; its output tok/s (0 when a request failed)."""
    requests = unique_requests(plan.closed_count(concurrency), plan.max_tokens, seed=seed, short=plan.short_prompts)
    run: PointRun = await driver.closed(concurrency, requests)
    failed = [r for r in run.records if r.outcome != OK]
    if failed:
        print(f"  {len(failed)} of {len(run.records)} failed: {failed[0].error[:160]}", file=sys.stderr, flush=True)
        return 0.0
    return summarize(run.records, run.duration_s).output_tokens_per_s


async def sweep_configs(system: str, served: Served, plan: Plan, configs: dict[str, list[str]],
                        concurrencies: list[int], rounds: int) -> dict[str, dict[int, list[float]]]:
    """Every configuration at every concurrency, `rounds` times, the order rotating."""
    rates: dict[str, dict[int, list[float]]] = {label: {c: [] for c in concurrencies} for label in configs}
    labels = list(configs)
    await warm_up(AdapterDriver(system, served, plan, [name for names in configs.values() for name in names]))
    for round_index in range(rounds):
        order = labels[round_index % len(labels):] + labels[:round_index % len(labels)]
        for label_index, label in enumerate(order):
            driver = AdapterDriver(system, served, plan, configs[label])
            try:
                for concurrency in concurrencies:
                    seed = 7000 + (round_index * len(labels) + label_index) * 100 + concurrency
                    rate = await run_point(driver, concurrency, seed, plan)
                    rates[label][concurrency].append(rate)
                    print(f"[{system}] round {round_index + 1} {label} c{concurrency}: {rate:.1f} tok/s",
                          file=sys.stderr, flush=True)
            finally:
                await driver.close()
    return rates


def table(system: str, settings: str, rates: dict[str, dict[int, list[float]]]) -> list[str]:
    lines = [f"\n{system} ({settings})\n", "| configuration | concurrency | output tok/s (median) | vs base only | rounds |",
             "|---|---:|---:|---:|---|"]
    base = {c: statistics.median(values) for c, values in rates["base only"].items()}
    for label, by_concurrency in rates.items():
        for concurrency, values in by_concurrency.items():
            median = statistics.median(values)
            ratio = f"{median / base[concurrency]:.2f}x" if base[concurrency] else "—"
            lines.append(f"| {label} | {concurrency} | {median:.1f} | {ratio} | "
                         f"{' / '.join(f'{v:.1f}' for v in values)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--quick", action="store_true", help="tiny model, few requests")
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--adapters", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="JSON of every round's figures")
    parser.add_argument("--peers-dir", type=Path, default=peers.default_peers_dir())
    parser.add_argument("--logs", type=Path, default=Path(".cache/lora-serving/logs"), help="the servers' logs")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.adapters.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    plan = Plan(max_tokens=8 if args.quick else 64, requests_per_slot=1.5, min_requests=4,
                short_prompts=args.quick, point_cap_s=120.0, drain_s=120.0)
    found = peers.find_peers(args.peers_dir)
    results: dict[str, dict] = {}
    lines = [f"# {cpu_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"{plan.max_tokens} tokens per request, greedy; rounds {args.rounds}, median round"]
    with tempfile.TemporaryDirectory(prefix="lora-serving-") as scratch:
        if args.quick:
            from tests.fixtures.tiny_model import save_tiny_model
            model_dir = save_tiny_model(Path(scratch) / "tiny")
        else:
            model_dir = default_model_dir(default_cache_dir())
            if not is_prepared(model_dir):
                raise SystemExit("default model not prepared: run `make prepare-model` first")
        root = Path(scratch) / "loras"
        root.mkdir()
        names = write_adapters(root, projection_shapes(model_dir), max(counts))
        adapters = {name: root / name for name in names}
        for system in (s.strip() for s in args.systems.split(",") if s.strip()):
            config = LaunchConfig(model_dir=model_dir, log_dir=args.logs / system,
                                  max_concurrency=max(concurrencies), tiny=args.quick)
            if system == "vllm":
                if found["vllm"].executable is None:
                    lines.append(f"\nvllm: skipped: {found['vllm'].reason}")
                    continue
                config = replace(config, vllm=found["vllm"].executable)
            env, extra = adapter_settings(system, adapters)
            config = replace(config, extra_env=env, extra_args=extra)
            try:
                with LAUNCHERS[system](config) as served:
                    configs = {"base only": [served.model],
                               **{f"{n} adapter{'s' if n > 1 else ''}": names[:n] for n in counts}}
                    rates = asyncio.run(sweep_configs(system, served, plan, configs, concurrencies, args.rounds))
                    settings = _short(served.settings, adapters)
            except (RuntimeError, TimeoutError, OSError) as error:
                lines.append(f"\n{system}: did not run: {str(error).splitlines()[0]}")
                tail = str(error).splitlines()[-12:]
                print("\n".join(tail), file=sys.stderr)
                continue
            results[system] = {"settings": settings, "rates": rates}
            lines += table(system, settings, rates)
    print("\n".join(lines))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0 if results else 1


def _short(settings: str, adapters: dict[str, Path]) -> str:
    """The settings with the adapters' paths left out."""
    for name, path in adapters.items():
        settings = settings.replace(f"{name}={path}", name)
    return settings


if __name__ == "__main__":
    sys.exit(main())
