"""Command-line parsing: defaults and refused combinations."""

from __future__ import annotations

import pytest

from loadsim.__main__ import parse_args


def test_defaults_run_a_minute_of_closed_loop() -> None:
    args = parse_args([])
    assert (args.users, args.duration, args.requests, args.rate, args.rates) == (8, 60.0, None, None, None)
    assert parse_args(["--requests", "5"]).duration is None


def test_rates_parse_to_a_list() -> None:
    assert parse_args(["--rates", "0.5, 1,2"]).rates == [0.5, 1.0, 2.0]


@pytest.mark.parametrize("argv", [
    ["--rate", "1", "--rates", "1,2"],
    ["--rates", "1,-2"],
    ["--rates", "fast"],
    ["--rates", ","],
    ["--users", "0"],
    ["--duration", "-1"],
    ["--rate", "0"],
])
def test_bad_arguments_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2 and "usage:" in capsys.readouterr().err
