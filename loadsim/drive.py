"""One closed-loop run against a gateway URL, for benchmarks that drive the load
simulator from Python."""

from __future__ import annotations

from loadsim.__main__ import first_model
from loadsim.runner import RunLimits, RunResult, run_closed_loop
from loadsim.transport import HttpTransport
from loadsim.users import make_users
from loadsim.workload import Workload


async def drive_closed_loop(url: str, workload: Workload, users: int, seconds: float, seed: int,
                            model: str | None = None, api_key: str | None = None) -> RunResult:
    """`users` simulated users for `seconds`; the model defaults to the server's first."""
    model = model or await first_model(url, api_key)
    transport = HttpTransport(url, api_key)
    try:
        return await run_closed_loop(make_users(workload, users, seed, model), transport,
                                     RunLimits(duration_s=seconds))
    finally:
        await transport.close()
