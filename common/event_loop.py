"""The event loop a service's asyncio main runs on (EVENT_LOOP).

`auto` (the default) runs uvloop where it is installed (it comes with uvicorn[standard]), else
asyncio's own loop; `uvloop` requires it; `asyncio` keeps the standard loop. uvloop runs the
same coroutines: what changes is the cost of each wake-up, socket write and callback, which a
request pays several times on its way through the gateway, the scheduler and a worker (on the
2-core AMD EPYC Zen 5 of docs/benchmarks.md: W1 at 32 streams ~3 % more tokens a second, an
identical cached prompt's first token ~0.5-1 ms sooner; a warm prefix's, bound by its step, alike).
gRPC's asyncio API runs on any asyncio loop (it polls on a thread of its own and hands its
completions to the loop), uvicorn runs on uvloop by default when serving alone."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from common.settings.env import SettingsError

T = TypeVar("T")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")

log = logging.getLogger(__name__)


def loop_name(choice: str) -> str:
    """The loop EVENT_LOOP=`choice` runs: "uvloop" or "asyncio". Raises SettingsError (naming
    the variable) for an unknown choice and for `uvloop` where uvloop is not installed."""
    if choice not in EVENT_LOOPS:
        raise SettingsError(f"EVENT_LOOP={choice!r} is invalid: one of {', '.join(EVENT_LOOPS)}")
    if choice == "asyncio":
        return "asyncio"
    if importlib.util.find_spec("uvloop") is None:
        if choice == "uvloop":
            raise SettingsError("EVENT_LOOP=uvloop is invalid: uvloop is not installed here "
                                "(`pip install uvloop`, or EVENT_LOOP=auto)")
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], choice: str) -> T:
    """Runs `main` to the end on the loop EVENT_LOOP=`choice` names (see loop_name)."""
    try:
        name = loop_name(choice)
    except BaseException:
        main.close()     # never awaited: closed, so no warning says it was forgotten
        raise
    log.info("event loop", extra={"event_loop": name})
    return _runner(name)(main)


def _runner(name: str) -> Callable[[Coroutine[Any, Any, T]], T]:
    if name == "asyncio":
        return asyncio.run
    import uvloop

    return uvloop.run
