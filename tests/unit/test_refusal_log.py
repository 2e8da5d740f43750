"""Refused internal calls are logged at most once per calling host per
interval, with the caller's address and a count of those left out."""

from __future__ import annotations

import logging

from common.transport.refusal_log import OTHER_HOSTS, RefusalLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _refusals(caplog) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.getMessage() == "call refused"]


def test_one_warning_per_host_per_interval_then_the_count(caplog) -> None:
    caplog.set_level(logging.WARNING)
    clock = Clock()
    refusals = RefusalLog(logging.getLogger("test"), "call refused", interval_s=10.0, clock=clock)
    assert refusals.refused("ipv4:10.0.0.7:40001", "/svc/M", "no token")
    # Other ports of the same host are the same caller; another host has its own line.
    assert not any(refusals.refused(f"ipv4:10.0.0.7:{port}", "/svc/M", "no token") for port in range(40002, 40500))
    assert refusals.refused("ipv6:[::1]:40001", "/svc/M", "no token")
    clock.now += 9.9
    assert not refusals.refused("ipv4:10.0.0.7:40600", "/svc/M", "no token")
    clock.now += 0.2
    assert refusals.refused("ipv4:10.0.0.7:40700", "/svc/N", "no token")
    first, local, again = _refusals(caplog)
    assert (first.peer, first.method, first.reason, first.suppressed) == (
        "ipv4:10.0.0.7:40001", "/svc/M", "no token", 0)
    assert local.peer == "ipv6:[::1]:40001" and local.suppressed == 0
    assert (again.peer, again.method, again.suppressed) == ("ipv4:10.0.0.7:40700", "/svc/N", 499)


def test_a_flood_from_many_hosts_is_bounded(caplog) -> None:
    caplog.set_level(logging.WARNING)
    clock = Clock()
    refusals = RefusalLog(logging.getLogger("test"), "call refused", interval_s=10.0, clock=clock, max_hosts=4)
    logged = [refusals.refused(f"ipv4:10.0.1.{n}:5", "/svc/M", "no token") for n in range(50)]
    assert logged == [True] * 5 + [False] * 45        # four hosts, then one line for all the others
    assert len(refusals._hosts) == 5 and OTHER_HOSTS in refusals._hosts
    clock.now += 11      # quiet hosts are forgotten: new ones get their own line again
    assert refusals.refused("ipv4:10.0.2.1:5", "/svc/M", "no token")
    assert len(refusals._hosts) == 1
    assert len(_refusals(caplog)) == 6


def test_an_odd_peer_is_logged_cut_short(caplog) -> None:
    caplog.set_level(logging.WARNING)
    refusals = RefusalLog(logging.getLogger("test"), "call refused")
    assert refusals.refused("unix:" + "x" * 1000, "/svc/M", "no token")
    assert not refusals.refused("unix:" + "x" * 1000, "/svc/M", "no token")
    (record,) = _refusals(caplog)
    assert len(record.peer) == 200
