"""EVENT_LOOP (common/event_loop.py): which loop each choice runs, the errors naming the
variable, and every service's settings reading it (default `auto`)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from common import event_loop
from common.settings.env import SettingsError
from services.gateway.settings import GatewaySettings
from services.kvcache.settings import KvCacheSettings
from services.scheduler.settings import SchedulerSettings
from services.worker.settings import WorkerSettings

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def _loop_type() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_runs_the_standard_loop() -> None:
    assert event_loop.loop_name("asyncio") == "asyncio"
    assert event_loop.run(_loop_type(), "asyncio").startswith("asyncio")


@pytest.mark.skipif(not HAS_UVLOOP, reason="uvloop is not installed")
@pytest.mark.parametrize("choice", ["auto", "uvloop"])
def test_auto_and_uvloop_run_uvloop_where_installed(choice: str) -> None:
    assert event_loop.loop_name(choice) == "uvloop"
    assert event_loop.run(_loop_type(), choice).startswith("uvloop")


def test_auto_falls_back_to_asyncio_and_uvloop_refuses_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a))
    assert event_loop.loop_name("auto") == "asyncio"
    assert event_loop.run(_loop_type(), "auto").startswith("asyncio")
    main = _loop_type()
    with pytest.raises(SettingsError, match="EVENT_LOOP=uvloop"):
        event_loop.run(main, "uvloop")
    assert main.cr_frame is None        # closed, never left pending


def test_an_unknown_choice_names_the_variable() -> None:
    with pytest.raises(SettingsError, match="EVENT_LOOP='libev'"):
        event_loop.loop_name("libev")


def test_every_service_reads_event_loop() -> None:
    readers = (GatewaySettings.from_env, SchedulerSettings.from_env, KvCacheSettings.from_env,
               WorkerSettings.from_env)
    for read in readers:
        assert read({}).event_loop == "auto"
        assert read({"EVENT_LOOP": "asyncio"}).event_loop == "asyncio"
        with pytest.raises(SettingsError, match="EVENT_LOOP"):
            read({"EVENT_LOOP": "twisted"})
