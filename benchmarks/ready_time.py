"""How long `make run` takes to be ready: launch to the ready banner, this checkout's
`fairserve run` against a baseline checkout's launcher, rounds alternating, medians.

    python -m benchmarks.ready_time --baseline /path/to/old/checkout --rounds 6

The baseline runs as its own launcher module (`--baseline-module`, default the one before the
package: `scripts.run_stack`, with its generated stubs in `gen/`); both use the default ports and
the default model (prepared beforehand), so nothing else may hold those ports.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fairserve.launcher.stack import ROOT

BANNER = "Ctrl-C stops"


def launch_to_banner(command: list[str], cwd: Path, pythonpath: str) -> float:
    env = {**os.environ, "PYTHONPATH": pythonpath, "LOG_DIR": tempfile.mkdtemp(prefix="ready-")}
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    output = ""
    try:
        while BANNER not in output:
            line = process.stdout.readline()
            if not line and process.poll() is not None:
                raise SystemExit(f"{' '.join(command)} exited before it was ready:\n{output}")
            output += line
        return time.monotonic() - started
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(60)
        time.sleep(2)   # the ports free again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the other checkout")
    parser.add_argument("--baseline-module", default="scripts.run_stack")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    fairserve = Path(sys.executable).parent / "fairserve"
    systems = {
        "baseline": ([sys.executable, "-m", args.baseline_module], args.baseline,
                     f"{args.baseline}:{args.baseline / 'gen'}"),
        "this": ([str(fairserve), "run"], Path(tempfile.mkdtemp(prefix="empty-")), str(ROOT)),
    }
    times: dict[str, list[float]] = {name: [] for name in systems}
    for round_ in range(args.rounds):
        for name in (("baseline", "this") if round_ % 2 == 0 else ("this", "baseline")):
            times[name].append(launch_to_banner(*systems[name]))
            print(f"round {round_ + 1} {name}: {times[name][-1]:.2f} s", flush=True)
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values):.2f} s  "
              f"({', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
