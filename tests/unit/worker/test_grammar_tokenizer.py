"""The grammar tokenizer's build: once, in the background or on first use; wait() tells
whether it is there (the worker waits for it before registering)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from services.worker.engine.sampling.grammar import GrammarTokenizer


def gated_build() -> tuple[threading.Event, list[int], Callable[[], str]]:
    """A build that waits for its event to be set, and counts its calls."""
    release = threading.Event()
    calls: list[int] = []

    def build() -> str:
        release.wait(5)
        calls.append(1)
        return "tokenizer"

    return release, calls, build


def test_wait_returns_once_the_background_build_is_done() -> None:
    release, calls, build = gated_build()
    tokenizer = GrammarTokenizer(build, background=True)
    release.set()
    assert tokenizer.wait() is True
    assert tokenizer.get() == "tokenizer" and calls == [1]


def test_a_failed_build_is_reported_by_wait_and_raised_by_get() -> None:
    def build() -> str:
        raise OSError("no tokenizer.json")

    tokenizer = GrammarTokenizer(build, background=False)
    assert tokenizer.wait() is False
    with pytest.raises(RuntimeError, match="no tokenizer.json"):
        tokenizer.get()


def test_start_builds_once_in_the_background() -> None:
    release, calls, build = gated_build()
    tokenizer = GrammarTokenizer(build, background=False)
    assert not tokenizer.started and calls == []             # nothing built until asked
    tokenizer.start()
    tokenizer.start()
    assert tokenizer.started
    release.set()
    assert tokenizer.get() == "tokenizer" and tokenizer.wait() and calls == [1]
    tokenizer.start()                                        # built: nothing more
    assert calls == [1]
