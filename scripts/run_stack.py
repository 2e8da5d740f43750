"""`make run`: starts the stack on the default ports, prints the URL, and
stops every process on Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from scripts.stack import ROOT, Stack, StackPorts


def main() -> int:
    env = {key: value for key, value in os.environ.items() if key.isupper()}
    ports = StackPorts(gateway=int(env.get("GATEWAY_PORT", 8000)))
    stack = Stack(ports=ports, env={}, log_dir=Path(env.get("LOG_DIR", ROOT / ".cache" / "logs")))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print("starting kvcache, scheduler, worker and gateway (logs in "
          f"{stack.log_dir}) ...", flush=True)
    try:
        stack.start(timeout_s=600)
        print(f"\nfairserve is ready at {stack.url}  (dashboard: {stack.url}/dashboard)\n")
        print("try:\n  curl -N " + stack.url + "/generate -d '{\"prompt\":\"The capital of France is\","
              "\"max_tokens\":20,\"raw\":true}'\n\nCtrl-C stops every service.", flush=True)
        while all(p.poll() is None for p in stack.processes.values()):
            time.sleep(0.5)
        dead = [name for name, p in stack.processes.items() if p.poll() is not None]
        print(f"{', '.join(dead)} exited; stopping the rest. Last log lines:\n{stack.tail(dead[0])}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
