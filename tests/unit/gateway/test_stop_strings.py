from __future__ import annotations

from services.gateway.text.stop_strings import StopStringMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    emitted: list[str] = []
    for delta in deltas:
        check = matcher.feed(delta)
        emitted.append(check.text)
        if check.stopped:
            return "".join(emitted), True
    return "".join(emitted) + matcher.flush(), False


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("abc").text == "abc"
    assert matcher.flush() == ""


def test_stop_inside_one_delta_cuts_before_it() -> None:
    assert run(["END"], ["hello END world"]) == ("hello ", True)


def test_stop_split_across_deltas_is_found_and_never_emitted() -> None:
    matcher = StopStringMatcher(["END"])
    first = matcher.feed("hello E")
    assert first.text == "hello " and not first.stopped  # "E" is held back
    second = matcher.feed("N")
    assert second.text == "" and not second.stopped
    third = matcher.feed("D and more")
    assert third.text == "" and third.stopped


def test_held_text_is_released_when_it_stops_matching() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("E").text == ""
    assert matcher.feed("x").text == "Ex"


def test_earliest_of_several_stops_wins() -> None:
    assert run(["world", "lo"], ["hello world"]) == ("hel", True)


def test_flush_returns_held_partial_match_at_the_end() -> None:
    assert run(["END"], ["the EN"]) == ("the EN", False)


def test_multibyte_stop_string() -> None:
    assert run(["東京"], ["Paris ", "東", "京 and more"]) == ("Paris ", True)


def test_empty_stop_strings_are_ignored() -> None:
    assert run(["", "x"], ["abc"]) == ("abc", False)
